"""Value checks for configuration fields: each raises ConfigError naming the field's path, the
allowed range and the value it got. Every config section validates through these, so a range
rule is written once and reads the same wherever it is reported."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from bdh_train.errors import ConfigError
from bdh_train.utils import suggest


def is_int(value: Any) -> bool:
    """A real integer (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def integer(path: str, value: Any) -> int:
    if not is_int(value):
        raise ConfigError(f"{path} must be an integer, got {value!r}")
    return int(value)


def int_at_least(path: str, value: Any, low: int) -> int:
    """An integer >= low; 1 and 0 read as 'positive' and 'non-negative'."""
    if not is_int(value) or value < low:
        what = {1: "a positive integer", 0: "a non-negative integer"}.get(
            low, f"an integer >= {low}"
        )
        raise ConfigError(f"{path} must be {what}, got {value!r}")
    return int(value)


def positive_int(path: str, value: Any) -> int:
    return int_at_least(path, value, 1)


def nonneg_int(path: str, value: Any) -> int:
    return int_at_least(path, value, 0)


def cpu_threads(path: str, value: Any) -> int:
    """A count of CPU threads for torch: 0 (automatic) up to this machine's CPUs
    (torch's thread pool crashed the process at 100000)."""
    nonneg_int(path, value)
    cpus = os.cpu_count() or 1
    if value > cpus:
        raise ConfigError(
            f"{path} = {value} is more than this machine's {cpus} CPUs; give at most {cpus} "
            "(0 = automatic)"
        )
    return int(value)


def seed(path: str, value: Any) -> int:
    """A seed torch.manual_seed takes: an integer from -2**63 to 2**64 - 1 (a larger one
    raised a RuntimeError out of torch)."""
    if not is_int(value) or not -(2**63) <= value < 2**64:
        raise ConfigError(f"{path} must be an integer from -2**63 to 2**64 - 1, got {value!r}")
    return int(value)


def interval(path: str, value: Any) -> int:
    """An `*_every` setting: a step interval where 0 switches the action off."""
    if not is_int(value) or value < 0:
        raise ConfigError(f"{path} must be a non-negative integer (0 disables it), got {value!r}")
    return int(value)


def int_in(path: str, value: Any, low: int, high: int, high_name: str = "") -> int:
    """An integer in [low, high]; `high_name` names the setting that bounds it."""
    if not is_int(value) or not low <= value <= high:
        bound = f"{high_name} ({high})" if high_name else str(high)
        raise ConfigError(f"{path} must be in [{low}, {bound}], got {value!r}")
    return int(value)


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def duration(path: str, value: Any) -> float:
    """A wall-clock duration in seconds: a non-negative number of seconds, or a string of
    hours, minutes and seconds in that order, each optional ('2h30m', '90m', '1.5h', '45s',
    '1h2m3s')."""
    if is_number(value) and value >= 0:
        return float(value)
    match = _DURATION.fullmatch(value) if isinstance(value, str) and value else None
    if match is None:
        raise ConfigError(
            f"{path} must be a duration: seconds (a non-negative number) or a string such as "
            f"'2h30m', '90m' or '45s', got {value!r}"
        )
    hours, minutes, seconds = (float(part or 0) for part in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def _range_text(low: float, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        if low == 0:
            return "a positive number" if low_open else "a non-negative number"
        return f"a number {'>' if low_open else '>='} {low:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def number(
    path: str,
    value: Any,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = True,
) -> float:
    """A finite number within [low, high) by default (ends open or closed as asked)."""
    ok = is_number(value) and (value > low if low_open else value >= low)
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(
            f"{path} must be {_range_text(low, high, low_open, high_open)}, got {value!r}"
        )
    return value


def boolean(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    return value


def string(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path} must be a string, got {value!r}")
    return value


def choice(path: str, value: Any, allowed: Sequence[str]) -> str:
    """One of `allowed`; a near miss gets the nearest name suggested."""
    if not isinstance(value, str) or value not in allowed:
        hint = suggest(value, allowed) if isinstance(value, str) else ""
        raise ConfigError(
            f"{path} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}"
        )
    return value


def multiple_of(path: str, value: int, step: int, step_name: str, *, zero_ok: bool) -> None:
    """`value` is a multiple of `step` (the setting `step_name`); 0 passes when `zero_ok`."""
    if (value == 0 and zero_ok) or (value > 0 and value % step == 0):
        return
    zero = "0 or " if zero_ok else ""
    raise ConfigError(f"{path} must be {zero}a multiple of {step_name} ({step}), got {value}")
