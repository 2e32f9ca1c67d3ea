"""One trainer per run directory: an advisory lock held for the run's life, and the rule that
a fresh run never writes into a directory holding another run."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from bdh_train.errors import ConfigError

LOCK_FILE = ".lock"
ERROR_LOG = "error.log"
"""Left by a failed start; it does not make a directory 'used'."""


class RunDirLock:
    """An exclusive `fcntl` lock on `run_dir/.lock`, which records the holder's pid. The
    kernel drops it when the process dies, so a killed run never leaves a stale lock."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        refuse_a_file(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"run directory {self.path.parent} is in use by another trainer (pid {holder}); "
                "wait for it to finish or stop it, or use another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a holder dropped without releasing (a trainer never run)
        self.release()


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


def check_fresh_run_dir(run_dir: Path, overwrite: bool) -> None:
    """A fresh run needs an empty (or absent) directory, unless `overwrite` clears it."""
    refuse_a_file(run_dir)
    used = used_entries(run_dir)
    if used and not overwrite:
        shown = ", ".join(used[:4]) + (", ..." if len(used) > 4 else "")
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({shown}); continue it with "
            f"--resume {run_dir}, start over with --overwrite, or choose another --run-dir"
        )


def clear_run_dir(run_dir: Path) -> None:
    """Remove an earlier run's files (call with the lock held)."""
    for name in used_entries(run_dir):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
