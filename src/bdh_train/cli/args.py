"""What the commands' parsers share: the parser (one-line refusals), the help formatter,
--device's choices, and the config options (--config, --set, --preset) of `train` and
`config`.

Importing this imports neither torch nor numpy: `bdh-train --help` builds every parser.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

DEVICES = ("auto", "cpu", "cuda")
"""--device choices: those of training.device (a test checks they agree; importing them would
import torch, which `--help` must not pay for)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it is None/False/empty or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        unset = default is None or default is False or default == [] or default == ""
        if unset or default == argparse.SUPPRESS or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose refusal is one `error:` line (what, which command, where its
    help is) and exit status 2, as every other refusal of bdh-train; argparse's own is the
    usage block, then the message."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"error: {self.prog}: {text}; see '{self.prog} --help'\n")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE.toml",
        help="config file (repeatable; later files override earlier ones)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override one value, e.g. training.max_steps=30",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="start from a preset: tiny | small | pathway (default: tiny when no --config)",
    )
