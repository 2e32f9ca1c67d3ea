"""`bdh-train train`: a run from a config, or one resumed from its run directory."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator

from bdh_train.cli.args import _add_config_args

EXIT_STOPPED = 75
"""A run stopped by SIGTERM or Ctrl-C after writing its checkpoint (resume it); 0 = finished."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a BDH (default: the tiny preset on builtin:shakespeare)"
    )
    _add_config_args(p)
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<date-time>)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="continue a run exactly from its latest checkpoint (default: --run-dir); with "
        "a --run-dir of another name, a new run there continues it and DIR is left as it is",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in a run directory that holds an earlier one, deleting it",
    )
    p.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: when the latest checkpoint is damaged, continue from the newest "
        "intact one",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from bdh_train.config import load_train_config
    from bdh_train.training.launch import plan_train, train

    plan = plan_train(args.run_dir, args.resume)
    args.run = plan.run  # an error is logged there once the command owns the directory
    cfg = load_train_config(plan.continued, args.config, args.overrides, args.preset)
    result = train(
        cfg,
        plan.run,
        plan.resume,
        args.overwrite,
        args.resume_fallback,
        _stop_on_signals,
        plan.checkpoint,
    )
    return EXIT_STOPPED if result.stopped_early else 0


@contextlib.contextmanager
def _stop_on_signals(request_stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and the first Ctrl-C ask the trainer to checkpoint at the next micro-step and
    return; a second Ctrl-C aborts at once."""
    interrupts = 0

    def on_interrupt(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            raise KeyboardInterrupt
        request_stop()  # first: a console that is gone must not stop the save
        with contextlib.suppress(OSError):
            print("stopping at the next micro-step (Ctrl-C again to abort)", file=sys.stderr)

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: request_stop()),
        signal.SIGINT: signal.signal(signal.SIGINT, on_interrupt),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
