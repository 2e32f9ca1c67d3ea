"""Small shared helpers: the nearest-name hint, dataclasses built from TOML tables with helpful
errors, the one atomic file write (temporary file, fsync, rename), and the one way to read a
file a user names: only a regular file (`open_regular`), whole up to a size limit
(`read_regular_file`) or line by line with a limit per line (`read_lines`), the
environment's cap on a command's steps (`steps_cap`), and whether this process is in a
torch.distributed process group (`in_process_group`)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import importlib
import os
import re
import stat
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from bdh_train.errors import BDHTrainError, ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


SYNONYMS = {
    "gpu": "cuda",
    "cuda:0": "cuda",
    "nvidia": "cuda",
    "bf16": "bfloat16",
    "fp32": "float32",
}
"""Names users give for an option under another name: suggested before a near spelling
(difflib finds 'cpu' nearest to 'gpu')."""


STEPS_CAP_ENV = "BDH_TRAIN_MAX_STEPS"
"""The environment variable that shortens every command for a smoke test (the README's
commands in its test, a config tried before a long run): a `train` command trains at most
this many optimizer steps past where it starts, a `merge` fine-tunes at most this many steps,
and `eval` (and every evaluation of a merge) reads at most this many batches (its memory
measures: this many sequences, trials or examples per cell)."""


def steps_cap(environ: Mapping[str, str] | None = None) -> int | None:
    """The positive integer in `STEPS_CAP_ENV` (default: os.environ); None when it is unset or
    empty. Anything else is a ConfigError."""
    env = os.environ if environ is None else environ
    value = env.get(STEPS_CAP_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"environment variable {STEPS_CAP_ENV} must be a positive integer (a number of "
            f"steps), got {value!r}; unset it to train the configured length"
        )
    return int(value)


def in_process_group() -> bool:
    """Whether this process is in an initialized torch.distributed process group, so that
    collectives can run (torch.distributed built, and a group made by torchrun's environment
    or by a caller)."""
    import torch.distributed as dist  # here: reading this module imports no torch

    return dist.is_available() and dist.is_initialized()


def suggest(name: str, options: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the option `name` is another name of (`SYNONYMS`), else
    the nearest valid name, or '' when nothing is close."""
    options = list(options)
    meant = SYNONYMS.get(name.lower())
    if meant in options:
        return f" (did you mean {meant!r}?)"
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w") -> Iterator[typing.IO[Any]]:
    """Write `path` through a temporary file in the same directory, then rename.

    A crash mid-write leaves the old file (or no file), never a half-written one. The file
    gets the mode a plain `open()` would give it (0o666 less the umask), not mkstemp's 0o600.
    A device, FIFO or socket at `path` is refused (BDHTrainError), never replaced; a link is
    replaced as a link, its target untouched. What a user names goes through the output
    policy first (`storage.output`).
    """
    path = Path(path)
    if path.is_dir():  # else the rename's error would name the temporary file
        raise IsADirectoryError(errno.EISDIR, "Is a directory, not a file", str(path))
    with contextlib.suppress(FileNotFoundError):
        found = os.lstat(path).st_mode
        if not (stat.S_ISREG(found) or stat.S_ISLNK(found)):  # a link is replaced as a link
            raise BDHTrainError(
                f"{path} is {not_regular_kind(found)}; bdh-train replaces only regular files: "
                "choose another path"
            )
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


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words ("a FIFO (named pipe)")."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")


def special_file_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when it is neither a regular file nor a directory (following links): 'a
    FIFO (named pipe)', 'a character device', ..., which a read would block on (a FIFO waits
    for a writer) or never finish (/dev/zero); None for a regular file, a directory or a path
    that does not exist."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else not_regular_kind(mode)


def size_text(n: int) -> str:
    """A byte count in the largest binary unit that divides it, and in bytes:
    '1 MiB (1048576 bytes)'; '1000 bytes' when no unit divides it."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit} ({n} bytes)"
    return f"{n} bytes"


_GIVE_A_FILE = "give the path of a file"


def open_regular(
    path: str | os.PathLike[str],
    what: str,
    error: type[BDHTrainError],
    fix: str = _GIVE_A_FILE,
) -> BinaryIO:
    """`path` opened for reading in binary mode, or `error` ("WHAT is a character device, not
    a regular file; FIX") when it is not a regular file: a device such as /dev/zero has no
    end, a FIFO blocks until something writes to it, a directory has no bytes. An OSError of
    opening (no such file, no permission) is raised as it is, for the caller to word."""
    # O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer;
    # reads of a regular file never block, with or without it.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = not_regular_kind(mode)
            raise error(f"{what} is {kind}, not a regular file; {fix}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(
    path: str | os.PathLike[str],
    limit: int,
    what: str,
    error: type[BDHTrainError],
    fix: str | None = None,
) -> bytes:
    """The bytes of regular file `path` (`open_regular`), refused with `error` when it has
    more than `limit` bytes: the size is checked before anything is read, and no more than
    `limit` + 1 bytes are read of a file that grows meanwhile. `fix`, when given, ends the
    messages."""
    with open_regular(path, what, error, fix or _GIVE_A_FILE) as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        has = f"has {size} bytes, more" if size > limit else "has more"
        raise error(f"{what} {has} than the {size_text(limit)} read" + (f"; {fix}" if fix else ""))
    return data


def read_lines(
    handle: BinaryIO, limit: int, what: str, error: type[BDHTrainError]
) -> Iterator[tuple[int, bytes]]:
    """Each line of `handle` (line end included) with its number from 1, refused with
    `error` ("WHAT:N: the line is longer than ...") at a line of more than `limit` bytes,
    of which no more than `limit` + 1 bytes are read."""
    number = 0
    while line := handle.readline(limit + 1):
        number += 1
        if len(line) > limit:
            raise error(
                f"{what}:{number}: the line is longer than {size_text(limit)}, the most a line "
                "may hold"
            )
        yield number, line


_JSON_KINDS = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def json_kind(value: object) -> str:
    """The JSON name of the type of a value `json.loads` gave ("number", "array"...)."""
    return _JSON_KINDS[type(value)]


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's run to six lines)."""
    text = re.sub(r"\[enforce fail at [^\]]*\][ .]*", "", str(exc))  # torch's C++ location
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def quoted(text: str, limit: int = 60) -> str:
    """`text` from a file, safe to echo in a one-line message: quoted with every character
    outside printable ASCII escaped (ascii()), cut after `limit` characters with its length
    said."""
    if len(text) <= limit:
        return ascii(text)
    return f"{ascii(text[:limit])}... ({len(text):,} characters)"
