"""Small shared helpers: dataclass construction from dicts with helpful errors, atomic writes."""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from bdh_train.errors import ConfigError

T = TypeVar("T")


def suggest(name: str, options: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest valid name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def build_dataclass(cls: type[T], data: dict[str, Any], prefix: str) -> T:
    """Instantiate dataclass `cls` from `data`, recursing into nested dataclass fields.

    Unknown keys raise ConfigError naming the key path and the nearest valid name.
    Type checks beyond that are the dataclass's own `validate()`'s job.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix} must be a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown key {prefix}.{key}{suggest(key, fields)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            kwargs[key] = build_dataclass(hint, value, f"{prefix}.{key}")
        else:
            kwargs[key] = value
    return cls(**kwargs)


@contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w") -> Iterator[typing.IO[Any]]:
    """Write `path` through a temporary file in the same directory, then rename.

    A crash mid-write leaves the old file (or no file), never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
