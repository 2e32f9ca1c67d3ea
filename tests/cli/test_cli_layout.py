"""The command line only parses and calls: no torch in `cli/` (the name in its code; strings
and comments aside), no command module over 200 lines, and the options of the commands that
load a checkpoint (generate, chat, eval, inspect) come from `cli/args.py`, not from another
command's module."""

from __future__ import annotations

import tokenize
from pathlib import Path

from test_layers import imports

import bdh_train.cli

CLI = Path(bdh_train.cli.__file__).parent
LONGEST_COMMAND_MODULE = 200


def _modules() -> list[Path]:
    return sorted(CLI.glob("*.py"))


def test_the_cli_computes_nothing_with_torch():
    found = []
    for path in _modules():
        with path.open("rb") as handle:
            for token in tokenize.tokenize(handle.readline):
                if token.type == tokenize.NAME and token.string == "torch":
                    found.append(f"cli/{path.name}:{token.start[0]}")
    assert found == [], (
        f"torch in the command line's code (move the work into the library): {found}"
    )


def test_no_command_module_is_over_200_lines():
    lines = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in _modules()}
    assert {name: n for name, n in lines.items() if n > LONGEST_COMMAND_MODULE} == {}


def test_commands_share_options_through_args_alone():
    """A command module imports `cli/args.py` and no other command's module."""
    shared = {"bdh_train.cli.args"}
    crossing = {
        path.name: sorted(
            found.target
            for found in imports(path)
            if found.target.startswith("bdh_train.cli.") and found.target not in shared
        )
        for path in _modules()
        if path.name not in ("__init__.py", "__main__.py")
    }
    assert {name: targets for name, targets in crossing.items() if targets} == {}
