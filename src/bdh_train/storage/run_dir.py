"""The run directory and everything about its layout: every file name in it, the lock that
lets one trainer own it, the error log, the run's tokenizer copy, the rules for starting a
fresh run in it or resuming it, and what a run that moved elsewhere needs.

::

    RUN/
      config.toml      the resolved config (data.tokenizer names RUN/tokenizer.json)
      tokenizer.json   the run's Hugging Face tokenizer (absent for byte runs)
      metrics.jsonl    one JSON row per logged step and evaluation
      loss.png         the loss curves (`bdh-train plot`)
      profile.png      where a step's time goes (`bdh-train profile`)
      tensorboard/     TensorBoard events (metrics.tensorboard)
      checkpoints/     step-NNNNNNN[-mMM]/ and the `latest` pointer (storage/checkpoint.py)
      .lock            held by the trainer that owns the run (its pid)
      error.log        errors of commands that owned the run (since its fresh start)
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

from bdh_train.errors import BDHTrainError, CheckpointError, ConfigError
from bdh_train.storage.places import (
    BYTES,
    CHECKPOINTS,
    CONFIG_FILE,
    ERROR_LOG,
    LAYOUT,
    LOCK_FILE,
    METRICS_FILE,
    PLOT_FILE,
    PROFILE_FILE,
    TENSORBOARD_DIR,
    TOKENIZER_FILE,  # the names live with the output policy's guard
    WANDB_DIR,
)
from bdh_train.utils import read_regular_file

CONFIG_MAX_BYTES = 1 << 20
"""The largest config file read: a run's saved config.toml, every key written, has about
2 KiB, so a larger file is no config, and is not read into memory."""
LOCK_MAX_BYTES = 4096
"""The most a run's .lock may hold to be kept and put back after a refused start: the lock
holds its holder's pid and a newline."""

RUNS_ROOT = "runs"
"""Where `bdh-train train` puts a run given no --run-dir: runs/<date>-<time>."""


class RunDirInUse(ConfigError):
    """Another trainer holds the run directory's lock."""


class RunDirLock:
    """An exclusive `fcntl` lock on `run_dir/.lock`, which records the holder's pid. The
    kernel drops it when the process dies, so a killed run never leaves a stale lock."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        refuse_a_file(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_no_follow(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(
                f"run directory {self.path.parent} is in use by another trainer (pid {holder}); "
                "wait for it to finish or stop it, or use another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def restore(self, data: bytes, atime_ns: int, mtime_ns: int) -> None:
        """Put back the lock file's earlier bytes and times (a refused start's undo)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
            os.utime(self._fd, ns=(atime_ns, mtime_ns))

    def held(self) -> bool:
        """Whether `run_dir/.lock` is still the file this lock holds. It is not once the
        directory was moved, removed or replaced: the kernel's lock stays on the old file,
        and the path then names another file or none."""
        if self._fd is None:
            return False
        try:
            now = os.lstat(self.path)
        except OSError:
            return False
        mine = os.fstat(self._fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def whereabouts(self) -> str | None:
        """Where the held lock file is now, as the system names its open file (Linux's
        /proc/self/fd: a path, with " (deleted)" after a removed one); None where the system
        does not say."""
        if self._fd is None:
            return None
        try:
            return os.readlink(f"/proc/self/fd/{self._fd}")
        except OSError:
            return None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a holder dropped without releasing (a trainer never run)
        self.release()


def open_no_follow(path: Path, flags: int) -> int:
    """A file descriptor of the run-directory file `path`, created (mode by the umask) when
    missing, never through a symbolic link: a link there is refused, so no file outside the
    run is written."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link; bdh-train writes a run's files only in the run "
                "directory itself: remove the link"
            ) from None
        raise


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline to the run-directory file `path` (never through a link)."""
    fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND)
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


def used_entries(run_dir: Path) -> list[str]:
    """What in `run_dir` belongs to an earlier run (everything but the lock and error log)."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_FILE, ERROR_LOG))


def refuse_a_file(run_dir: Path) -> None:
    """A run directory must be a directory (or not exist yet)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"run directory {run_dir} is a file, not a directory; choose another --run-dir"
        )


class RunDirLost(BDHTrainError):
    """The run directory was moved, removed or replaced while its trainer ran: the trainer
    stops before it writes to that path again, so it never writes into a run that another
    command started there."""


def lost_line(path: Path, whereabouts: str | None) -> str:
    """The error of a trainer whose run directory `path` is no longer the one it locked:
    where its run went (`RunDirLock.whereabouts`) and how to go on."""
    deleted = whereabouts is not None and whereabouts.endswith(" (deleted)")
    moved = None if whereabouts is None or deleted else Path(whereabouts)
    if deleted:
        went = "its lock file was deleted, with the directory or alone"
    elif moved is None or moved.name != LOCK_FILE or moved.parent == path.resolve():
        went = "it was moved, removed or replaced"  # unknown, or a file NFS kept of it
    else:
        went = (
            f"it was moved to {moved.parent}: continue it there with bdh-train train "
            f"--resume {moved.parent}"
        )
    return (
        f"run directory {path} is no longer this trainer's ({path / LOCK_FILE} is not the lock "
        f"it holds): {went}; stopped without writing to {path} again, so what is there now "
        "is left as it is"
    )


class RunDir:
    """One run directory: the paths of its files, its lock, its error log and the rules for
    starting or resuming a run in it.

    The directory is the command's own (`owned`) when it did not exist before the command
    named it and no other trainer took it since (`lock`), or once a trainer was built on it:
    only then does `log_error` write into it.
    A stamped directory (no --run-dir) that a failure left with nothing but the lock and log
    is removed instead. A refused command leaves the directory byte for byte as it was:
    taking the lock
    rewrites the lock file's pid, and giving it back after a refusal puts the file back
    (or removes it, and the directory, where the command created them)."""

    def __init__(
        self, path: str | os.PathLike[str], fresh: bool = True, stamped: bool = False
    ) -> None:
        """`fresh`: a directory for a new run (one a resume names is never created for its
        error log). `stamped`: the runs/<date>-<time> directory of a command given no
        --run-dir, which a failure that wrote nothing else leaves no trace of (no directory
        holding only its error log: `log_error`)."""
        self.path = Path(path)
        self.stamped = stamped
        self._existed = self.path.exists()
        self._parent_existed = self.path.parent.exists()
        self._lock: RunDirLock | None = None
        self.owned = fresh and not self._existed
        """Whether the command may write its error log here."""
        self._lock_file: tuple[bytes, int, int] | None = None
        self._claimed_lock: tuple[int, int] | None = None
        """(device, inode) of the lock file when the command claimed the directory."""

    def __str__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------ file names
    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def loss_plot(self) -> Path:
        return self.path / PLOT_FILE

    @property
    def profile_plot(self) -> Path:
        return self.path / PROFILE_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tokenizer_copy(self) -> Path:
        """The run's copy of its Hugging Face tokenizer, which its config names."""
        return self.path / TOKENIZER_FILE

    @property
    def error_log(self) -> Path:
        return self.path / ERROR_LOG

    # ------------------------------------------------------------------ ownership
    def lock(self) -> None:
        """Take the run's lock; refused when another trainer holds it. A lock this command
        holds already is checked to be the directory's still (`check_owned`)."""
        self.check_owned()
        if self._lock is None:
            lock_file = self.path / LOCK_FILE
            self._lock_file = None
            if lock_file.is_file() and not lock_file.is_symlink():
                st = lock_file.stat()
                held = read_regular_file(
                    lock_file,
                    LOCK_MAX_BYTES,
                    f"the lock file {lock_file}",
                    ConfigError,
                    "it is no lock bdh-train wrote (a pid): move it away or delete it",
                )
                self._lock_file = (held, st.st_atime_ns, st.st_mtime_ns)
            try:
                self._lock = RunDirLock(self.path).acquire()
            except RunDirInUse:
                # a command that named the same absent directory (two stamped at one instant)
                # made it and holds it: the directory is that command's, never this one's
                self.owned = False
                raise

    def unlock(self, refused: bool = False) -> None:
        """Release the lock. After a refused start (`refused`), also undo what taking it did:
        the lock file's earlier bytes and times are put back, or, when the directory held
        none, the file is removed, and the directory too when the command made it."""
        if self._lock is None:
            return
        lock, self._lock = self._lock, None
        if refused and self._lock_file is not None:  # restored while still held
            with contextlib.suppress(OSError):
                lock.restore(*self._lock_file)
        lock.release()
        if refused and self._lock_file is None:
            lock.path.unlink(missing_ok=True)
            if not self._existed:
                with contextlib.suppress(OSError):
                    self.path.rmdir()

    def claim(self) -> None:
        """The directory is this command's now (a trainer was built on it, on every process):
        its error log is written, and the lock file it has is remembered, so that a process
        holding no lock (a rank other than the main one) can tell the directory was replaced
        too (`check_owned`)."""
        self.owned = True
        with contextlib.suppress(OSError):
            found = os.lstat(self.path / LOCK_FILE)
            self._claimed_lock = (found.st_dev, found.st_ino)

    def lost(self) -> bool:
        """Whether the directory at this path is no longer the one this command locked (the
        main process: its held lock, `RunDirLock.held`) or claimed (the others: the lock file
        it found then): moved, removed or replaced since."""
        if self._lock is not None:
            return not self._lock.held()
        if self._claimed_lock is None:
            return False
        try:
            found = os.lstat(self.path / LOCK_FILE)
        except OSError:
            return True
        return (found.st_dev, found.st_ino) != self._claimed_lock

    def check_owned(self) -> None:
        """Raise `RunDirLost` when the directory is `lost`, which every writer of a running
        trainer calls before it writes, on every process; the error log is then no longer
        this command's."""
        if not self.lost():
            return
        self.owned = False
        where = None if self._lock is None else self._lock.whereabouts()
        raise RunDirLost(lost_line(self.path, where))

    def log_error(self, message: str) -> None:
        """Append `message` to the error log of a directory this command owns (else nothing:
        the error is on stderr). A directory the command named but never created gets only
        the log."""
        if not self.owned or self.lost():
            return
        if self.stamped and not used_entries(self.path):
            self._remove_unused()
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            stamp = _dt.datetime.now().isoformat(timespec="seconds")
            append_line(self.error_log, f"{stamp} {message}")
        except (OSError, ConfigError):  # the error itself is on stderr
            pass

    def _remove_unused(self) -> None:
        """Remove this command's directory (and the runs/ folder it made for it) when it holds
        nothing but the lock file and error log."""
        with contextlib.suppress(OSError):
            if self.path.is_dir():
                for name in (LOCK_FILE, ERROR_LOG):
                    (self.path / name).unlink(missing_ok=True)
                self.path.rmdir()
            if not self._parent_existed:
                self.path.parent.rmdir()

    # ------------------------------------------------------------------ fresh and resumed runs
    def check_fresh(self, overwrite: bool) -> None:
        """A fresh run needs an empty (or absent) directory, unless `overwrite` clears an
        earlier run from it: a directory holding anything but a run's own files (`LAYOUT`),
        or whose checkpoints/ holds anything but checkpoints, is never cleared."""
        refuse_a_file(self.path)
        used = used_entries(self.path)
        foreign = (
            [name for name in used if name not in LAYOUT]
            + _foreign_checkpoints(self.path / CHECKPOINTS)
            + _foreign_events(self.path / TENSORBOARD_DIR)
        )
        if foreign:
            replaces = "--overwrite replaces only a run directory (or an empty one); "
            raise ConfigError(
                f"run directory {self.path} holds files that are not a bdh-train run's "
                f"({_shown(foreign)}); {replaces if overwrite else ''}choose another --run-dir"
            )
        if used and not overwrite:
            shown = _shown(used)
            raise ConfigError(
                f"run directory {self.path} already holds a run ({shown}); continue it with "
                f"--resume {self.path}, start over with --overwrite, or choose another --run-dir"
            )

    def clear(self) -> None:
        """Remove an earlier run's files (call with the lock held, after `check_fresh`):
        only the names of a run's layout, a link as a link."""
        for name in used_entries(self.path):
            if name not in LAYOUT:
                continue
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def forget_failed_starts(self) -> None:
        """Remove the error log a fresh run finds (call with the lock held, once the run is
        accepted): its lines are the errors of starts that failed before this run, or of the
        run `--overwrite` replaces, none of them this run's."""
        self.error_log.unlink(missing_ok=True)

    def check_resumable(self) -> None:
        """A resume needs the run's saved config."""
        if not self.path.exists():
            raise CheckpointError(
                f"cannot resume: {self.path} does not exist; give a run directory written by "
                "bdh-train train, or one of its checkpoints (RUN/checkpoints/step-N)"
            )
        if not self.config.is_file():
            raise CheckpointError(
                f"cannot resume: {self.config} does not exist (is {self.path} a run "
                "directory written by bdh-train train?)"
            )

    def check_no_links(self) -> None:
        """Refuse a run whose checkpoints/, tensorboard/ or wandb/ is a symbolic link: a
        trainer writes (and prunes) there, and never through a link to somewhere else."""
        for name in (CHECKPOINTS, TENSORBOARD_DIR, WANDB_DIR):
            path = self.path / name
            if path.is_symlink():
                raise ConfigError(
                    f"{path} is a symbolic link to {os.readlink(path)}; bdh-train writes a "
                    "run's files only in the run directory itself: replace the link with "
                    "the folder it points to, or start a fresh run elsewhere"
                )

    def check_has_metrics(self) -> None:
        """`plot` and `profile` read a run's metrics.jsonl."""
        if not self.metrics.is_file():
            raise ConfigError(f"{self.metrics} does not exist: is {self.path} a run directory?")

    def moved_tokenizer_override(self) -> list[str]:
        """`--set` overrides for resuming this run after it moved: [] or one that names the
        run's own tokenizer copy.

        A run's config.toml names its copy of a Hugging Face tokenizer by absolute path, so a
        run directory moved or copied elsewhere still names the old place. When that file no
        longer exists and this run directory holds its own copy, the copy is named instead
        (the checkpoint's fingerprint check still applies). Later overrides, the user's, still
        win; `bdh-train train --resume` applies it only when no --config file is given, since
        one may name the tokenizer."""
        try:
            named = read_saved_config(self.path)["data"]["tokenizer"]
        except (OSError, ConfigError, ValueError, KeyError, TypeError):
            return []  # loading the config reports what is wrong with it
        own_copy = self.tokenizer_copy
        if not isinstance(named, str) or named == BYTES or Path(named).name != TOKENIZER_FILE:
            return []
        if Path(named).exists() or not own_copy.is_file():
            return []
        # a TOML basic string: JSON's escapes are TOML's, except surrogate pairs (kept raw here)
        return [f"data.tokenizer={json.dumps(str(own_copy.resolve()), ensure_ascii=False)}"]


def config_path(directory: Path) -> Path:
    """The config.toml of a run directory or checkpoint directory."""
    return directory / CONFIG_FILE


def read_saved_config(directory: Path) -> dict[str, Any]:
    """The TOML table of the config.toml of a run or checkpoint directory, read as a regular
    file of at most CONFIG_MAX_BYTES: ConfigError when it is larger or no regular file,
    OSError when it cannot be read, ValueError when it is not UTF-8 or not TOML (for callers
    that only peek at a key; loading the config words what is wrong with it)."""
    path = config_path(directory)
    text = read_regular_file(path, CONFIG_MAX_BYTES, f"config file {path}", ConfigError)
    return tomllib.loads(text.decode("utf-8"))


def run_of_checkpoint(checkpoint: Path) -> RunDir | None:
    """The run directory a checkpoint directory (RUN/checkpoints/step-N) belongs to."""
    run = checkpoint.parent.parent
    return RunDir(run, fresh=False) if checkpoint.parent.name == CHECKPOINTS else None


def check_outside_checkpoints(source: Path, out: str | os.PathLike[str]) -> None:
    """Refuse an output path inside the checkpoints a command reads (`source`: a run
    directory, whose checkpoints folder counts, or a checkpoint directory), judged by paths
    alone."""
    if not source.is_dir():
        return
    kept = source / CHECKPOINTS if (source / CHECKPOINTS).is_dir() else source
    if Path(out).resolve().is_relative_to(kept.resolve()):
        raise ConfigError(
            f"OUT {out} is inside {kept}, the checkpoints it exports from, which it "
            "would damage; write the export outside it"
        )


_CHECKPOINT_ENTRY = re.compile(
    r"step-\d{7,}(?:-m\d{2,})?|\.(?:tmp|old)-step-\d{7,}(?:-m\d{2,})?-.+"
)
"""A checkpoint directory's name, or that of one being written or set aside (checkpoint.py)."""


def _foreign_checkpoints(checkpoints: Path) -> list[str]:
    """What in a run's checkpoints folder is not the run's, which `clear` would remove with
    it: anything but checkpoint directories (written, being written or set aside) and the
    `latest` file; a link there is never the run's."""
    if checkpoints.is_symlink() or not checkpoints.is_dir():
        return []  # a link in place of the folder is removed as a link; its target is kept
    return sorted(
        f"{CHECKPOINTS}/{entry.name}"
        for entry in checkpoints.iterdir()
        if entry.is_symlink()
        or not (
            (entry.name == "latest" and entry.is_file())
            or (entry.is_dir() and _CHECKPOINT_ENTRY.fullmatch(entry.name))
        )
    )


_EVENTS = re.compile(r"events\.out\.tfevents\..+")
"""The name of a TensorBoard event file (what metrics.tensorboard writes)."""


def _foreign_events(folder: Path) -> list[str]:
    """What in a run's tensorboard folder is not an event file, which `clear` would remove
    with it."""
    if folder.is_symlink() or not folder.is_dir():
        return []  # a link in place of the folder is removed as a link; its target is kept
    return sorted(
        f"{TENSORBOARD_DIR}/{entry.name}"
        for entry in folder.iterdir()
        if entry.is_symlink() or not (entry.is_file() and _EVENTS.fullmatch(entry.name))
    )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
