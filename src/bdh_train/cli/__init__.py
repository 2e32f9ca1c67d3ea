"""`bdh-train`: train, generate, chat, eval, prepare, corpus, config, plot, profile, plan,
export, grow, merge, import-official, inspect.

Every user error (bad config, data, checkpoint) is a BDHTrainError: printed as one line on
stderr with exit status 2, never a traceback.

Each command is a plain function of the parsed arguments, listed in COMMANDS; the module of
its group adds its parser (`register`): train, generate (generate, chat), evaluate (eval),
prepare (prepare, corpus), tools (config, plot, profile, plan), export, compose (grow, merge,
import-official), inspect. What the parsers share is in `args`; what a command runs is in
the package of its application, so a command module only parses and calls. Torch, numpy and
the rest of the package are imported inside the commands, so `--help` pays for none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Sequence

from bdh_train import __version__
from bdh_train.cli import compose, evaluate, export, generate, inspect, prepare, tools, train
from bdh_train.cli.args import _HelpFormatter, _Parser
from bdh_train.cli.train import EXIT_STOPPED
from bdh_train.errors import BDHTrainError

__all__ = ["COMMANDS", "EXIT_STOPPED", "EXIT_USER_ERROR", "build_parser", "main"]

EXIT_USER_ERROR = 2

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": train.cmd_train,
    "generate": generate.cmd_generate,
    "chat": generate.cmd_chat,
    "eval": evaluate.cmd_eval,
    "prepare": prepare.cmd_prepare,
    "corpus": prepare.cmd_corpus,
    "config": tools.cmd_config,
    "plot": tools.cmd_plot,
    "profile": tools.cmd_profile,
    "plan": tools.cmd_plan,
    "export": export.cmd_export,
    "grow": compose.cmd_grow,
    "merge": compose.cmd_merge,
    "import-official": compose.cmd_import_official,
    "inspect": inspect.cmd_inspect,
}
"""Each command's name -> the function that runs it (its parser: the group's `register`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bdh-train",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(  # type: ignore[method-assign]
        sub.add_parser, formatter_class=_HelpFormatter
    )
    for group in (train, generate, evaluate, prepare, tools, export, compose, inspect):
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run = None  # the RunDir of a command that may log its error there
    try:
        return COMMANDS[args.command](args)
    except BDHTrainError as exc:
        _report(args, f"error: {exc}")
        return EXIT_USER_ERROR
    except OSError as exc:  # disk full, file size limit, read-only directory
        where = f": {exc.filename}" if exc.filename else ""
        message = f"error: {exc.strerror or exc}{where}"
        if args.run is not None:
            from bdh_train.storage.checkpoint import io_advice

            message += f"; {io_advice(args.run.path, exc)}"
        _report(args, message)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _report(args, "interrupted", log=False)
        return 130
    finally:
        _let_go_of_a_closed_stdout()


def _report(args: argparse.Namespace, message: str, log: bool = True) -> None:
    """`message` on stderr (when it is still open) and in the error log of a run directory
    the command owns. The line and its newline go out in one write, so the lines of several
    processes sharing stderr (torchrun's ranks) never run into each other."""
    with contextlib.suppress(OSError):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    if log and args.run is not None:
        args.run.log_error(message)


def _let_go_of_a_closed_stdout() -> None:
    """Point stdout at /dev/null when its reader is gone (a pipe into `tee` or `head` that
    closed), so the interpreter's last flush cannot fail and change the exit status."""
    try:
        sys.stdout.flush()
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
