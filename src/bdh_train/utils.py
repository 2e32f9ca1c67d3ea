"""Small shared helpers: the nearest-name hint, dataclasses built from TOML tables with helpful
errors, and the one atomic file write (temporary file, fsync, rename)."""

from __future__ import annotations

import dataclasses
import difflib
import errno
import importlib
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bdh_train.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def suggest(name: str, options: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest valid name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def dataclass_in(hint: Any) -> tuple[str, type] | None:
    """('one' | 'optional' | 'list', cls) when a type hint is a dataclass, an Optional of one,
    or a list of one; None otherwise."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "one", hint
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and isinstance(inner[0], type) and dataclasses.is_dataclass(inner[0]):
            return "optional", inner[0]
    if origin is list and len(args) == 1:
        (inner,) = args
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            return "list", inner
    return None


def renamed_key(cls: type, key: str, prefix: str) -> str:
    """The current name of `key` in dataclass `cls`: an old name listed in the class's
    `RENAMED` mapping is translated, with a deprecation line on stderr."""
    new = getattr(cls, "RENAMED", {}).get(key)
    if new is None:
        return key
    print(
        f"warning: {prefix}.{key} is deprecated; it is read as {prefix}.{new} (rename it)",
        file=sys.stderr,
    )
    return new


def build_dataclass(cls: type[T], data: Any, prefix: str) -> T:
    """Instantiate dataclass `cls` from a table, recursing into dataclass fields, Optional
    dataclass fields and lists of dataclasses.

    Unknown keys raise ConfigError naming the key path and the nearest valid name. Type and
    range checks are the dataclass's own `validate()`'s job.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix} must be a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key = renamed_key(cls, key, prefix)
        if key not in fields:
            raise ConfigError(f"unknown key {prefix}.{key}{suggest(key, fields)}")
        where = f"{prefix}.{key}"
        kind = dataclass_in(hints[key])
        if kind is None or value is None:
            kwargs[key] = value
        elif kind[0] == "list":
            kwargs[key] = (
                value
                if not isinstance(value, list)
                else [
                    build_dataclass(kind[1], item, f"{where}[{i}]")
                    if isinstance(item, dict)
                    else item
                    for i, item in enumerate(value)
                ]
            )
        elif kind[0] == "optional" and not isinstance(value, dict):
            kwargs[key] = value
        else:
            kwargs[key] = build_dataclass(kind[1], value, where)
    return cls(**kwargs)


def current_umask() -> int:
    """The process's file-mode creation mask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w") -> Iterator[typing.IO[Any]]:
    """Write `path` through a temporary file in the same directory, then rename.

    A crash mid-write leaves the old file (or no file), never a half-written one. The file
    gets the mode a plain `open()` would give it (0o666 less the umask), not mkstemp's 0o600.
    """
    path = Path(path)
    if path.is_dir():  # else the rename's error would name the temporary file
        raise IsADirectoryError(errno.EISDIR, "Is a directory, not a file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def lazy_names(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's PEP 562 `__getattr__` and `__dir__` for its public names, each imported
    from its home module (`homes`: name -> module) on first use and then kept, so importing
    the package, or one of its submodules, imports none of the others."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
