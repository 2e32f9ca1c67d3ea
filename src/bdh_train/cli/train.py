"""`bdh-train train`: a run from a config, or one resumed from its run directory."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from bdh_train.cli.args import _add_config_args
from bdh_train.errors import CheckpointError, ConfigError

EXIT_STOPPED = 75
"""A run stopped by SIGTERM or Ctrl-C after writing its checkpoint (resume it); 0 = finished."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a BDH (default: the tiny preset on builtin:pydoc)")
    _add_config_args(p)
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<date-time>)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="continue a run exactly from its latest checkpoint (default: --run-dir)",
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
    from bdh_train.config import load_config
    from bdh_train.distributed.env import DistContext
    from bdh_train.trainer import CONFIG_FILE, Trainer, moved_tokenizer_override, resolve_device

    resume = args.resume is not None
    run_dir = Path(args.resume or args.run_dir or "") if resume else None
    if resume and str(run_dir) in ("", "."):
        raise ConfigError("--resume needs a run directory: --resume DIR or --run-dir DIR")
    if run_dir is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(args.run_dir or f"runs/{stamp}")
    args.error_dir = run_dir
    if resume:
        saved = run_dir / CONFIG_FILE
        if not saved.is_file():
            raise CheckpointError(
                f"cannot resume: {saved} does not exist (is {run_dir} a run "
                "directory written by bdh-train train?)"
            )
        moved = [] if args.config else moved_tokenizer_override(run_dir)
        overrides = [*moved, *args.overrides]
        cfg = load_config([saved, *args.config], overrides, default_preset=False)
    else:
        cfg = load_config(args.config, args.overrides, args.preset)
    dist_ctx = DistContext.from_env(
        resolve_device(cfg.training.device).type, cfg.parallel.collective_timeout_s
    )
    trainer = None
    try:
        trainer = Trainer(
            cfg,
            run_dir,
            resume=resume,
            dist_ctx=dist_ctx,
            overwrite=args.overwrite,
            resume_fallback=args.resume_fallback,
        )
        with _stop_on_signals(trainer.request_stop):
            result = trainer.run()
    except BaseException as exc:
        # the traceback's frames (Trainer.run's `self` among them) would keep the trainer
        # alive past the collection below; the messages keep their files and lines
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        # The trainer sits in reference cycles, and its wrapped model (DDP's reducer, FSDP,
        # pipeline stages) holds the process group: left to the cycle collector, gloo's
        # group could be freed during interpreter shutdown, where a torchrun rank once
        # aborted ("terminate called without an active exception"). Freed here, the group
        # goes while the interpreter is whole, then is destroyed.
        trainer = None
        gc.collect()
        dist_ctx.close()
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
        print("stopping at the next micro-step (Ctrl-C again to abort)", file=sys.stderr)
        request_stop()

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: request_stop()),
        signal.SIGINT: signal.signal(signal.SIGINT, on_interrupt),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
