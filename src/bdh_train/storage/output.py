"""The one output policy of every command that writes (a run's checkpoints excepted, which
storage/checkpoint.py publishes inside the run with the same `rename_into_place`):

- `check_output`: whether a path may take an output, judged before anything is computed. It
  is refused when it is, or lies inside, a checkpoint or a run's own files
  (`places.guarded_place`); when it is a device, FIFO or socket; when it is a link to
  something (never written through nor replaced); and, without `force`, when it exists at
  all (a dangling link included). `force` replaces a regular file with a regular file, a
  directory with a directory the command says is of its kind, and a dangling link as a link.
- `write_file`: a file written through a temporary beside it, fsynced, renamed into place.
- `publish_dir`: a directory built in a locked temporary beside its place and published by
  `rename_into_place` (an existing one, when allowed, set aside first and removed after); a
  failure removes the temporary and the parent folders the call created.
- `clean_leftovers`: what a killed `publish_dir` of the same output left (a temporary, or
  the earlier output set aside, put back when its replacement never arrived).

`rename_into_place` is the one way a built directory is published, a run's checkpoints
included (storage/checkpoint.py keeps its temporaries inside checkpoints/ under names of its
own): each file gets the mode `open()` gives under the umask, every file and folder is
fsynced, and only then is the directory renamed into place. `put_back` is the one way a copy
set aside by a killed publish comes back.

Every refusal is one error naming the path, what it is and what to do, raised before the
disk is touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bdh_train.errors import BDHTrainError, ConfigError
from bdh_train.storage.places import guarded_place
from bdh_train.utils import atomic_write, current_umask, first_line, not_regular_kind

TMP = "tmp"
OLD = "old"
_FIX = "free space (or raise the file size limit, or make the directory writable) and run it again"


def _shown(path: str | os.PathLike[str]) -> str:
    return os.fspath(path)


def check_output(
    path: str | os.PathLike[str],
    what: str,
    error: type[BDHTrainError] = ConfigError,
    *,
    force: bool | None = False,
    directory: bool = False,
    same_kind: Callable[[Path], None] | None = None,
) -> Path:
    """The absolute path of output `path` (its last part not followed), or `error` when the
    policy (module docstring) refuses it. `what` names it in messages ("--out"); `force` is
    the user's --force (None: the command has no such flag); `directory`: the output is a
    directory (else a regular file); `same_kind(path)` raises the command's own refusal of an
    existing directory that is not of its kind (without it no directory is replaced)."""
    shown = _shown(path)
    final = Path(os.path.abspath(path))
    place = guarded_place(Path(os.path.realpath(final.parent)) / final.name)
    if place is not None:
        raise error(
            f"{what} {shown} is {place}; bdh-train never writes an output there, even with "
            "--force: choose a path outside it"
        )
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return final
    except NotADirectoryError:
        raise error(
            f"{what} {shown}: a folder on the path is a file; choose another path"
        ) from None
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        target = os.readlink(final)
        if os.path.exists(final):
            raise error(
                f"{what} {shown} is a symbolic link to {target}; bdh-train never writes through "
                "a link nor replaces one, even with --force: remove it or choose another path"
            )
        if not force:
            fix = (
                "pass --force to replace the link itself (its target is not written)"
                if (force is not None)
                else "remove it"
            )
            raise error(
                f"{what} {shown} is a symbolic link to {target}, which does not exist; {fix}, "
                "or choose another path"
            )
        return final
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise error(
            f"{what} {shown} is {not_regular_kind(mode)}; bdh-train replaces only regular "
            "files and directories, even with --force: choose another path"
        )
    wanted, found = ("a directory", "a file") if directory else ("a file", "a directory")
    if stat.S_ISDIR(mode) != directory:
        raise error(f"{what} {shown} is {found}, not {wanted}: choose another path")
    if force is None or (force and directory and same_kind is None):
        raise error(f"{what} {shown} exists: choose a new path for the output")
    if not force:
        raise error(
            f"{what} {shown} already exists; pass --force to replace it, or choose another path"
        )
    if directory:
        assert same_kind is not None
        same_kind(final)
    return final


def write_file(
    path: str | os.PathLike[str],
    data: bytes,
    what: str,
    error: type[BDHTrainError] = ConfigError,
    *,
    force: bool | None = False,
) -> Path:
    """Write `data` to the file `path` under the policy (`check_output`): through a
    temporary beside it, fsynced and renamed, so the file is whole or as it was. A write
    that fails (a full disk, the file size limit) is `error` naming the file. Returns
    `path`."""
    final = check_output(path, what, error, force=force)
    try:
        with atomic_write(final, "wb") as handle:
            handle.write(data)
    except OSError as exc:
        raise error(
            f"cannot write {what} {_shown(path)} ({exc.strerror or first_line(exc)}); nothing "
            f"was written: {_FIX}"
        ) from exc
    return Path(path)


def fsync_dir(path: Path) -> None:
    """Put a directory's entries (renames into it) on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _settle_tree(directory: Path) -> None:
    """Give every file under `directory` the mode `open()` gives under the umask (safetensors
    creates its files 0o600) and put every file and folder (and `directory`) on disk."""
    mode = 0o666 & ~current_umask()
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fchmod(handle.fileno(), mode)
                os.fsync(handle.fileno())
        fsync_dir(Path(root))


def rename_into_place(
    building: Path,
    final: Path,
    aside: Callable[[], Path],
    before_rename: Callable[[], None] | None = None,
) -> Path | None:
    """Publish the directory `building` (made beside `final` by `make_dir`) as `final`: its
    files get the umask's mode and every file and folder is put on disk (an OSError naming
    the file when that fails), `before_rename()` runs, then `building` is renamed to `final`
    and the parent folder synced. An existing `final` (a link included) is first moved to
    `aside()`, a path inside a new folder beside it that a kill between the two renames
    leaves for the caller's recovery (`put_back`), and is put back when the rename fails
    (`NotRenamedError`; the empty folder is removed).
    Returns where the replaced copy went, for the caller to remove once the new one is in
    use; None when nothing was replaced."""
    _settle_tree(building)
    if before_rename is not None:
        before_rename()
    kept = aside() if os.path.lexists(final) else None
    try:
        if kept is not None:
            os.replace(final, kept)
        try:
            os.replace(building, final)
        except OSError as exc:
            if kept is not None:
                os.replace(kept, final)
            raise NotRenamedError(exc, kept is not None) from exc
    except OSError:
        if kept is not None:  # empty unless the copy could not be put back
            with contextlib.suppress(OSError):
                kept.parent.rmdir()
        raise
    fsync_dir(final.parent)
    return kept


class NotRenamedError(OSError):
    """The built directory could not be renamed into place (the rename's OSError); an
    existing one set aside for it (`replaced`) has been put back."""

    def __init__(self, exc: OSError, replaced: bool) -> None:
        super().__init__(exc.errno, exc.strerror, exc.filename, None, exc.filename2)
        self.replaced = replaced


def put_back(kept: Path, final: Path) -> None:
    """Bring back `kept`, the copy of `final` a killed `rename_into_place` set aside, when
    `final` is missing (the kill came between the two renames)."""
    if not os.path.lexists(final) and kept.exists():
        os.replace(kept, final)


def make_dir(parent: Path, prefix: str) -> Path:
    """A new hidden directory in `parent` named `prefix` and random letters, with the mode a
    plain mkdir gives (mkdtemp's is 0o700)."""
    made = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(made, 0o777 & ~current_umask())
    return made


def leftover_prefix(final: Path, role: str) -> str:
    """The name start of `final`'s temporary (`TMP`) or set-aside (`OLD`) directories."""
    return f".{final.name}.{role}-"


def locked_dir(final: Path, role: str) -> tuple[Path, int]:
    """A new directory beside `final` (`leftover_prefix`) and an open descriptor of it that
    holds an exclusive `flock` until closed. The kernel drops the lock when the process dies,
    however it dies: an unlocked one has no writer (`clean_leftovers`)."""
    while True:
        made = make_dir(final.parent, leftover_prefix(final, role))
        fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: never removed by another command
            return made, fd
        try:
            if os.path.samestat(os.stat(made), os.fstat(fd)):
                return made, fd
        except FileNotFoundError:
            pass
        # another command of this output saw it unlocked between mkdtemp and flock
        os.close(fd)


def _only_plain(directory: Path) -> bool:
    """Whether everything under `directory` is a regular file or a folder (no link, device
    or FIFO: a command's temporary never holds one)."""
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            mode = os.lstat(os.path.join(root, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return False
    return True


def clean_leftovers(
    final: str | os.PathLike[str], ours: Callable[[Path], bool] | None = None
) -> list[Path]:
    """Remove what killed commands writing `final` left beside it, and return what was
    removed: a temporary whose writer is gone, and an earlier output set aside for a
    replacement, which is first put back when `final` is missing (the kill came between the
    two renames). Kept: one whose writer still runs (it holds its lock), one holding a link,
    device or FIFO, a temporary `ours` (when given) does not recognise, and every one on a
    file system without `flock`."""
    final = Path(os.path.abspath(final))
    starts = {leftover_prefix(final, role): role for role in (TMP, OLD)}
    try:
        with os.scandir(final.parent) as found:
            entries = [
                (e.path, role)
                for e in found
                for start, role in starts.items()
                if e.name.startswith(start)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry, role in sorted(entries):
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # not a directory, a link, or gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = Path(entry)
            if not os.path.samestat(os.stat(path), os.fstat(fd)):
                continue
            if role == OLD:
                put_back(path / final.name, final)
            if _only_plain(path) and (role == OLD or ours is None or ours(path)):
                shutil.rmtree(path)
                removed.append(path)
        except OSError:  # locked by its live writer (BlockingIOError), no flock, or gone
            continue
        finally:
            os.close(fd)
    return removed


def _make_parents(folder: Path) -> Path | None:
    """Make `folder` and the folders above it that are missing; the highest one made."""
    missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    folder.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


def _remove_made(folder: Path, top: Path | None) -> None:
    """Remove the empty folders from `folder` up to `top`, those `_make_parents` made."""
    if top is None:
        return
    for path in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            path.rmdir()
        if path == top:
            return


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Raise what fails while writing `path` as an OSError that names it: an OSError of a
    plain `write` names no file, and safetensors wraps its OSError in its own error."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or first_line(exc), str(path)) from exc
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":
            raise
        raise OSError(errno.EIO, first_line(exc), str(path)) from exc


def _failed_file(exc: BaseException, building: Path, final: Path, fallback: Path) -> Path:
    """The output file a write error names, in the published directory's terms."""
    name = getattr(exc, "filename", None)
    if isinstance(name, str) and Path(name).is_relative_to(building):
        return final / Path(name).relative_to(building)
    return fallback


def publish_dir(
    final: str | os.PathLike[str],
    write: Callable[[Path], None],
    what: str,
    command: str,
    error: type[BDHTrainError] = ConfigError,
    *,
    force: bool | None = None,
    same_kind: Callable[[Path], None] | None = None,
    ours: Callable[[Path], bool] | None = None,
) -> Path:
    """Publish the directory `final`: `write(building)` fills a locked temporary beside it,
    and `rename_into_place` puts every file on disk, checks the policy (`check_output`)
    again and renames the directory into place; an existing `final` that the policy lets it
    replace is set aside first and removed after (and put back when the rename fails). What
    killed runs of `command` (e.g. 'export --hf') left for `final` is removed first, each
    said on stderr.
    A failed write is `error` naming the file (nothing is left, not even the parent folders
    this call made). Returns `final` as an absolute path."""
    checks: dict[str, Any] = dict(force=force, directory=True, same_kind=same_kind)
    final = check_output(final, what, error, **checks)
    for left in clean_leftovers(final, ours):
        print(
            f"notice: removed '{left}', left by a `bdh-train {command}` of '{final}' that did "
            "not finish",
            file=sys.stderr,
        )
    made = _make_parents(final.parent)
    building, lock = locked_dir(final, TMP)
    try:
        try:
            write(building)
        except OSError as exc:
            raise _write_error(exc, building, final, error) from exc

        def still_allowed() -> None:  # the policy again, just before the rename
            check_output(final, what, error, **checks)

        _swap(building, final, error, still_allowed)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        _remove_made(final.parent, made)
        raise
    finally:
        os.close(lock)
    return final


def _write_error(
    exc: OSError, building: Path, final: Path, error: type[BDHTrainError]
) -> BDHTrainError:
    """`error` naming the file of the published directory that could not be written."""
    failed = _failed_file(exc, building, final, final)
    reason = exc.strerror or first_line(exc)
    return error(f"cannot write {failed} ({reason}); nothing was written: {_FIX}")


def _swap(
    building: Path, final: Path, error: type[BDHTrainError], before_rename: Callable[[], None]
) -> None:
    """`rename_into_place` with the output policy's set-aside folder: a locked one beside
    `final` (`locked_dir`, which `clean_leftovers` knows), removed after. A file that cannot
    be put on disk, or a rename that fails, is `error`."""
    locks: list[int] = []
    settled = False

    def aside() -> Path:
        folder, lock = locked_dir(final, OLD)
        locks.append(lock)
        return folder / final.name

    def on_disk() -> None:  # every file is on disk: what fails from here is no write
        nonlocal settled
        settled = True
        before_rename()

    try:
        kept = rename_into_place(building, final, aside, on_disk)
        if kept is not None:
            shutil.rmtree(kept.parent, ignore_errors=True)
    except NotRenamedError as exc:
        left = "; the previous one is left in place" if exc.replaced else ""
        raise error(f"cannot move the new {final} into place: {exc.strerror or exc}{left}") from exc
    except OSError as exc:
        if settled:
            raise
        raise _write_error(exc, building, final, error) from exc
    finally:
        for lock in locks:
            os.close(lock)
