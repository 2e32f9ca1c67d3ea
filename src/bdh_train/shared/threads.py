"""How many CPU threads torch uses: the count asked for (`training.threads`, `--threads`), or
with 0 one picked from the cores other processes leave free.

torch's thread team waits for its slowest thread at every operation, so on a machine where
another process keeps a core busy, two threads on two cores ran training 2.3x slower than
one (580 vs 1,335 tok/s). The automatic count is therefore the cores this process may use
less those other work keeps busy, rounded, at least 1 and at most torch's own count (one per
physical core, or OMP_NUM_THREADS). Other work is the smaller of the 1-minute load average
(smooth, but it remembers this process's own earlier work) and the tasks running right now
besides the one reading (current, but it flickers), both from /proc/loadavg. When
OMP_NUM_THREADS is set (torchrun sets it to 1 for several processes a node), that choice
stands.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

LOADAVG = Path("/proc/loadavg")


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count set, and why, in words (the start banner's)."""

    threads: int
    reason: str

    def describe(self) -> str:
        return f"{self.threads} ({self.reason})"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def read_loadavg() -> str | None:
    """The text of /proc/loadavg, or None where there is none (not Linux)."""
    try:
        return LOADAVG.read_text()
    except OSError:
        return None


def other_work(loadavg: str | None) -> float:
    """The cores other work keeps busy, from /proc/loadavg's text: the smaller of the 1-minute
    load and the running tasks less the reader; 0 when unknown."""
    if loadavg is None:
        return 0.0
    try:
        fields = loadavg.split()
        load = float(fields[0])
        running = int(fields[3].split("/")[0])
    except (IndexError, ValueError):
        return 0.0
    return max(0.0, min(load, running - 1))


def choose_threads(
    requested: int, current: int, cpus: int, loadavg: str | None, omp: str | None
) -> ThreadChoice:
    """The thread count for `requested` (0 = automatic) given torch's `current` count, the
    usable `cpus`, /proc/loadavg's text and OMP_NUM_THREADS (module docstring)."""
    if requested:
        return ThreadChoice(requested, "as set")
    if omp:
        return ThreadChoice(current, f"OMP_NUM_THREADS={omp}")
    busy = other_work(loadavg)
    free = math.floor(cpus - busy + 0.5)
    threads = max(1, min(current, free))
    return ThreadChoice(
        threads, f"auto: {cpus} CPUs, {busy:.1f} busy with other work; torch's count {current}"
    )


def set_threads(requested: int) -> ThreadChoice:
    """Set torch's CPU thread count to `choose_threads`'s for this machine now."""
    choice = choose_threads(
        requested,
        torch.get_num_threads(),
        usable_cpus(),
        read_loadavg(),
        os.environ.get("OMP_NUM_THREADS"),
    )
    torch.set_num_threads(choice.threads)
    return choice
