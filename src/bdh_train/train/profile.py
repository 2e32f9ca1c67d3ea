"""Where a train step's time and memory go, at zero cost when profiling is off.

Three switches, as config (`training.profile`, `training.profile_memory`) or environment:

* step timing — forward and backward wall time of every micro-step (device synchronized);
* detail — also timed probes: extra passes on the step's batch through parts of the model
  (embedding, first layer, head, whole model; forward alone and with backward);
* memory — readings before the step, after its forward and after its backward: in-use bytes
  (CUDA allocated, or the bytes malloc has handed out on CPU) and, on CUDA, reserved bytes.

The step calls the profiler's hooks unconditionally; a disabled profiler is `NullProfiler`,
whose hooks do nothing, so no clock is read and no device is synchronized.

The trainer writes one row per logged optimizer step into metrics.jsonl (`profile_row`);
`profile_table` and `plot_profile` (behind `bdh-train profile RUN_DIR`) read them back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bdh_train.errors import ConfigError
from bdh_train.train.allocator import glibc_malloc
from bdh_train.utils import atomic_write

PROFILE_MODES = ("off", "step", "detail")
"""`training.profile`: no profiling, step timing, step timing plus the detail probes."""

ENV_PROFILE = "BDH_PROFILE"
"""Overrides `training.profile` for one run: off | step | detail (1/true = step, 0/false = off)."""
ENV_PROFILE_DETAIL = "BDH_PROFILE_DETAIL"
"""1/true: the detail probes (implies step timing); 0/false: no probes."""
ENV_PROFILE_MEMORY = "BDH_PROFILE_MEMORY"
"""1/true or 0/false: overrides `training.profile_memory` for one run."""

PROBES: dict[str, str] = {
    "embed": "embedding (+backward)",
    "first_layer_forward": "first layer forward",
    "first_layer_forward_backward": "first layer forward+backward",
    "model_forward": "whole model forward",
    "logits_loss": "logits -> loss (+backward)",
    "hidden_logits_loss": "hidden -> logits -> loss (+backward)",
    "model_forward_backward": "whole model forward+backward",
}
"""Detail probe name -> what it times; the metrics field is `probe_<name>_s`."""

MEMORY_POINTS = ("before", "after_forward", "after_backward")
_MIB = 1024 * 1024
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


# ------------------------------------------------------------------ settings
@dataclass(frozen=True)
class ProfileSettings:
    """What to record: `mode` from PROFILE_MODES, and whether to read memory."""

    mode: str = "off"
    memory: bool = False

    @property
    def enabled(self) -> bool:
        """Whether anything is recorded (memory readings come with step timing)."""
        return self.mode != "off" or self.memory

    @property
    def detail(self) -> bool:
        return self.mode == "detail"

    @classmethod
    def resolve(
        cls, mode: str, memory: bool, environ: Mapping[str, str] | None = None
    ) -> ProfileSettings:
        """The config's settings with the environment's overrides applied (a variable that is
        set wins over the config; an unreadable value is a ConfigError naming it)."""
        env = os.environ if environ is None else environ
        if ENV_PROFILE in env:
            value = env[ENV_PROFILE].strip().lower()
            if value in PROFILE_MODES:
                mode = value
            else:
                mode = "step" if _flag(ENV_PROFILE, value, f" or one of {PROFILE_MODES}") else "off"
        if ENV_PROFILE_DETAIL in env:
            if _flag(ENV_PROFILE_DETAIL, env[ENV_PROFILE_DETAIL]):
                mode = "detail"
            elif mode == "detail":
                mode = "step"
        if ENV_PROFILE_MEMORY in env:
            memory = _flag(ENV_PROFILE_MEMORY, env[ENV_PROFILE_MEMORY])
        if memory and mode == "off":
            mode = "step"
        return cls(mode, memory)

    def describe(self) -> str:
        parts = [f"profiling: {self.mode}"]
        if self.memory:
            parts.append("memory readings")
        return ", ".join(parts)


def _flag(name: str, value: str, also: str = "") -> bool:
    value = value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"environment variable {name} must be 1/true/yes/on or 0/false/no/off{also}, got {value!r}"
    )


# ------------------------------------------------------------------ readings
def _rss_bytes() -> int:
    """Resident set size of this process (current, from /proc; peak as a fallback)."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * resource.getpagesize()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (every field a size_t)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _host_bytes_in_use() -> int:
    """Bytes malloc has handed out and not taken back (heap chunks + mmapped chunks, from
    glibc's mallinfo2): tensors' host memory, whatever the allocator keeps resident for reuse
    (training.host_allocator = 'retain' keeps freed memory resident, so the resident set would
    not fall when tensors are freed). The resident set where mallinfo2 is missing."""
    libc = glibc_malloc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return _rss_bytes()
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


@dataclass(frozen=True)
class MemoryReading:
    in_use: int
    """CUDA bytes allocated by tensors, or the bytes malloc has handed out on CPU."""
    reserved: int | None = None
    """CUDA bytes held by the caching allocator (None on CPU)."""

    @classmethod
    def read(cls, device: torch.device) -> MemoryReading:
        if device.type == "cuda":
            return cls(
                int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))
            )
        return cls(_host_bytes_in_use())

    def max(self, other: MemoryReading | None) -> MemoryReading:
        if other is None:
            return self
        reserved = self.reserved
        if other.reserved is not None:
            reserved = other.reserved if reserved is None else max(reserved, other.reserved)
        return MemoryReading(max(self.in_use, other.in_use), reserved)


@dataclass
class StepProfile:
    """One micro-step's timings (seconds) and memory readings (None when not read)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    memory_before: MemoryReading | None = None
    memory_after_forward: MemoryReading | None = None
    """The highest reading at the end of a forward (TBPTT runs one forward per window)."""
    memory_after_backward: MemoryReading | None = None
    probes_s: dict[str, float] = field(default_factory=dict)
    """Detail probe name -> seconds."""


def profile_row(profiles: Sequence[StepProfile]) -> dict[str, float]:
    """The metrics.jsonl fields of the micro-steps of one optimizer step: times summed;
    memory before the first, the highest after a forward, after the last backward (MiB)."""
    row: dict[str, float] = {
        "forward_s": sum(p.forward_s for p in profiles),
        "backward_s": sum(p.backward_s for p in profiles),
    }
    for name in PROBES:
        times = [p.probes_s[name] for p in profiles if name in p.probes_s]
        if times:
            row[f"probe_{name}_s"] = sum(times)
    after_forward: MemoryReading | None = None
    for p in profiles:
        if p.memory_after_forward is not None:
            after_forward = p.memory_after_forward.max(after_forward)
    readings = {
        "before": profiles[0].memory_before if profiles else None,
        "after_forward": after_forward,
        "after_backward": profiles[-1].memory_after_backward if profiles else None,
    }
    for point, reading in readings.items():
        if reading is None:
            continue
        row[f"mem_{point}_mib"] = reading.in_use / _MIB
        if reading.reserved is not None:
            row[f"mem_{point}_reserved_mib"] = reading.reserved / _MIB
    return row


# ------------------------------------------------------------------ profilers
class NullProfiler:
    """Profiling off: every hook is a no-op."""

    detail = False

    def begin_step(self) -> None: ...
    def begin_forward(self) -> None: ...
    def end_forward(self) -> None: ...
    def begin_backward(self) -> None: ...
    def end_backward(self) -> None: ...
    def end_step(self) -> StepProfile | None:
        return None


class StepProfiler:
    """Records forward/backward wall time (device synchronized) per micro-step, and memory
    readings and detail probe times where its `ProfileSettings` ask for them."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        settings: ProfileSettings = ProfileSettings("step"),
    ) -> None:
        self.device = torch.device(device)
        self.settings = settings
        self._current = StepProfile()
        self._t0 = 0.0
        self._totals: dict[str, float] = {}
        self.recorded = 0
        """Micro-steps recorded so far."""

    @classmethod
    def of(cls, settings: ProfileSettings, device: torch.device) -> StepProfiler | None:
        """The profiler `settings` ask for on `device`; None when they record nothing."""
        return cls(device, settings) if settings.enabled else None

    @property
    def detail(self) -> bool:
        """Whether the step should run the detail probes (`probe`)."""
        return self.settings.detail

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _memory(self) -> MemoryReading | None:
        return MemoryReading.read(self.device) if self.settings.memory else None

    def begin_step(self) -> None:
        self._current = StepProfile(memory_before=self._memory())

    def begin_forward(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def end_forward(self) -> None:
        self._sync()
        self._current.forward_s += time.perf_counter() - self._t0
        reading = self._memory()
        if reading is not None:
            self._current.memory_after_forward = reading.max(self._current.memory_after_forward)

    def begin_backward(self) -> None:
        self._t0 = time.perf_counter()

    def end_backward(self) -> None:
        self._sync()
        self._current.backward_s += time.perf_counter() - self._t0
        self._current.memory_after_backward = self._memory()

    @contextlib.contextmanager
    def probe(self, name: str) -> Iterator[None]:
        """Time the block as detail probe `name` (device synchronized at both ends)."""
        if name not in PROBES:
            raise ValueError(f"unknown profile probe {name!r}; known: {', '.join(PROBES)}")
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        probes = self._current.probes_s
        probes[name] = probes.get(name, 0.0) + time.perf_counter() - start

    def end_step(self) -> StepProfile:
        for key, value in profile_row([self._current]).items():
            self._totals[key] = self._totals.get(key, 0.0) + value
        self.recorded += 1
        return self._current

    def summary(self) -> str:
        """The mean micro-step of everything recorded, as `profile_table` shows it."""
        if not self.recorded:
            return "profile: no steps recorded"
        mean = {key: total / self.recorded for key, total in self._totals.items()}
        return profile_table([mean], unit="micro-step", count=self.recorded)


# ------------------------------------------------------------------ reading the rows back
def profile_rows(metrics: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The metrics.jsonl rows that carry a step profile."""
    return [dict(r) for r in metrics if "forward_s" in r]


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return sum(values) / len(values) if values else None


def _probe_total(row: Mapping[str, Any]) -> float:
    return sum(float(row.get(f"probe_{name}_s", 0.0)) for name in PROBES)


def profile_table(
    rows: Sequence[Mapping[str, Any]], unit: str = "optimizer step", count: int | None = None
) -> str:
    """Where the time of a mean `unit` goes (ms and share of the whole step where it was
    measured), the detail probes' times, and the memory readings (MiB)."""
    if not rows:
        return "profile: no profile rows"
    n = count if count is not None else len(rows)
    lines = [f"profile: mean {unit} over {n} {unit}s"]
    parts = {
        "forward": _mean(rows, "forward_s"),
        "backward": _mean(rows, "backward_s"),
        "detail probes": sum(_probe_total(r) for r in rows) / len(rows),
    }
    measured = sum(v or 0.0 for v in parts.values())
    whole = _mean(rows, "step_s")
    if whole is not None:
        parts["other (data, accumulation, optimizer)"] = whole - measured
    total = whole if whole is not None else measured
    width = 40
    lines.append(f"  {'where the time goes':<{width}}{'ms':>10}{'share':>9}")
    for label, value in parts.items():
        if value is None or (label == "detail probes" and value == 0.0):
            continue
        share = f"{100 * value / total:8.1f}%" if total > 0 else f"{'-':>9}"
        lines.append(f"  {label:<{width}}{value * 1e3:10.2f}{share}")
    if whole is not None:
        lines.append(f"  {'whole step':<{width}}{whole * 1e3:10.2f}{100.0:8.1f}%")
    probes = {name: _mean(rows, f"probe_{name}_s") for name in PROBES}
    if any(v is not None for v in probes.values()):
        lines.append(f"  {'detail probes (each a separate pass)':<{width}}{'ms':>10}")
        for name, value in probes.items():
            if value is not None:
                lines.append(f"  {PROBES[name]:<{width}}{value * 1e3:10.2f}")
    memory = {point: _mean(rows, f"mem_{point}_mib") for point in MEMORY_POINTS}
    if any(v is not None for v in memory.values()):
        cuda = any(f"mem_{point}_reserved_mib" in r for r in rows for point in MEMORY_POINTS)
        kind = "CUDA allocated" if cuda else "malloc'd host bytes"
        header = f"  {'memory, MiB (in use = ' + kind + ')':<{width}}{'in use':>10}"
        lines.append(header + (f"{'reserved':>10}" if cuda else ""))
        for point, value in memory.items():
            if value is None:
                continue
            label = "before the step" if point == "before" else point.replace("_", " ")
            line = f"  {label:<{width}}{value:10.1f}"
            reserved = _mean(rows, f"mem_{point}_reserved_mib")
            lines.append(line + (f"{reserved:10.1f}" if reserved is not None else ""))
    return "\n".join(lines)


def plot_profile(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """A stacked bar per profiled step (forward, backward, detail probes, the rest of the
    step) and, when there are probes, their mean times; written atomically as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rows:
        raise ValueError("no profile rows to plot")
    probes = [name for name in PROBES if any(f"probe_{name}_s" in r for r in rows)]
    fig = Figure(figsize=(11 if probes else 7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if probes else fig.add_subplot()
    steps = [int(r.get("step", i + 1)) for i, r in enumerate(rows)]
    stacks = {
        "forward": [float(r["forward_s"]) * 1e3 for r in rows],
        "backward": [float(r.get("backward_s", 0.0)) * 1e3 for r in rows],
        "detail probes": [_probe_total(r) * 1e3 for r in rows],
        "other": [
            max(
                0.0,
                float(r["step_s"])
                - float(r["forward_s"])
                - float(r.get("backward_s", 0.0))
                - _probe_total(r),
            )
            * 1e3
            if "step_s" in r
            else 0.0
            for r in rows
        ],
    }
    colours = {
        "forward": "#4c9be8",
        "backward": "#f28e2b",
        "detail probes": "#9c9c9c",
        "other": "#c5e0b4",
    }
    bottom = [0.0] * len(rows)
    for label, heights in stacks.items():
        if not any(heights):
            continue
        ax.bar(steps, heights, bottom=bottom, color=colours[label], label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ms")
    ax.set_title("where a step's time goes", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    if probes:
        side = fig.add_subplot(1, 2, 2)
        means = [(_mean(rows, f"probe_{name}_s") or 0.0) * 1e3 for name in probes]
        side.barh([PROBES[name] for name in probes], means, color="#9c9c9c")
        side.invert_yaxis()
        side.set_xlabel("ms (mean per step)")
        side.set_title("detail probes (separate passes)", fontsize=10)
        side.tick_params(axis="y", labelsize=8)
        side.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    with atomic_write(out, "wb") as handle:
        fig.savefig(handle, format="png", dpi=100)
    return out
