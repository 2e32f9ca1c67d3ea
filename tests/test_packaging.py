"""What pyproject.toml claims about Python versions holds: the lowest version it accepts has
every language feature the package uses, ruff checks for that same version, and no dependency
is left over for a version it no longer accepts."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _claims() -> tuple[tuple[int, int], dict]:
    data = tomllib.loads(PYPROJECT.read_text())
    match = re.fullmatch(r">=\s*3\.(\d+)", data["project"]["requires-python"])
    assert match, f"requires-python should be one lower bound, got {data['project']!r}"
    return (3, int(match.group(1))), data


def test_lowest_claimed_python_has_what_the_package_uses():
    lowest, _ = _claims()
    # The accumulator's errors attach their detail with BaseException.add_note (new in 3.11),
    # and the config loader reads TOML with the standard library's tomllib (new in 3.11).
    assert lowest >= (3, 11), f"requires-python admits {lowest}, which lacks add_note/tomllib"
    assert sys.version_info[:2] >= lowest, "the suite runs on a Python the package refuses"


def test_ruff_targets_the_lowest_claimed_python_and_no_dependency_is_dead():
    lowest, data = _claims()
    assert data["tool"]["ruff"]["target-version"] == f"py3{lowest[1]}"
    for dep in data["project"]["dependencies"]:
        marker = re.search(r"python_version\s*<\s*['\"]3\.(\d+)['\"]", dep)
        assert not (marker and (3, int(marker.group(1))) <= lowest), (
            f"dependency {dep!r} applies only to Pythons below {lowest}, which are not accepted"
        )
