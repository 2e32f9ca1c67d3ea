"""Per-step forward/backward time and memory, at zero cost when disabled.

The step calls the profiler's hooks unconditionally; a disabled profiler is `NullProfiler`,
whose hooks do nothing, so no clock is read and no device is synchronized.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field

import torch


def _rss_bytes() -> int:
    """Resident set size of this process (current, from /proc; peak as a fallback)."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class StepProfile:
    forward_s: float = 0.0
    backward_s: float = 0.0
    memory_before: int = 0
    memory_after_forward: int = 0
    memory_after_backward: int = 0


class NullProfiler:
    """Profiling off: every hook is a no-op."""

    def begin_step(self) -> None: ...
    def begin_forward(self) -> None: ...
    def end_forward(self) -> None: ...
    def begin_backward(self) -> None: ...
    def end_backward(self) -> None: ...
    def end_step(self) -> StepProfile | None:
        return None


@dataclass
class StepProfiler:
    """Records forward/backward wall time (device synchronized) and memory per train step."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    steps: list[StepProfile] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._current = StepProfile()
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return _rss_bytes()

    def begin_step(self) -> None:
        self._current = StepProfile(memory_before=self._memory())

    def begin_forward(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def end_forward(self) -> None:
        self._sync()
        self._current.forward_s += time.perf_counter() - self._t0
        self._current.memory_after_forward = max(self._current.memory_after_forward, self._memory())

    def begin_backward(self) -> None:
        self._t0 = time.perf_counter()

    def end_backward(self) -> None:
        self._sync()
        self._current.backward_s += time.perf_counter() - self._t0
        self._current.memory_after_backward = self._memory()

    def end_step(self) -> StepProfile:
        self.steps.append(self._current)
        return self._current

    def summary(self) -> str:
        """A table of mean forward/backward time and memory over the recorded steps."""
        if not self.steps:
            return "profile: no steps recorded"
        n = len(self.steps)

        def mean(attr: str) -> float:
            return sum(getattr(s, attr) for s in self.steps) / n

        mib = 1024 * 1024
        kind = "CUDA allocated" if self.device.type == "cuda" else "process RSS"
        rows = [
            f"profile over {n} steps ({kind})",
            f"{'forward ms':>14} {'backward ms':>12} {'mem before MiB':>15} "
            f"{'after fwd MiB':>14} {'after bwd MiB':>14}",
            f"{mean('forward_s') * 1e3:14.2f} {mean('backward_s') * 1e3:12.2f} "
            f"{mean('memory_before') / mib:15.1f} {mean('memory_after_forward') / mib:14.1f} "
            f"{mean('memory_after_backward') / mib:14.1f}",
        ]
        return "\n".join(rows)
