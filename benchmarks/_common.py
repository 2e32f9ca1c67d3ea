"""Shared helpers of the benchmarks: fresh-subprocess measurements, peak RSS, tables, estimates.

Memory method (used by every benchmark here): each measurement runs in a fresh Python process
(`run_worker`). The worker builds its model, optimizer and data and runs one primer step on a
16-token slice (so thread pools, kernel caches, gradients and AdamW state exist), releases
free heap pages (`malloc_trim`) and records its resident set size (`rss_mib`, from
/proc/self/statm) as the baseline; then it runs the measured steps and reads the process's
peak RSS (`peak_rss_mib`: VmHWM of /proc/self/status). Tables report both the raw
peak and delta = peak - baseline: the memory the measured steps added on top of a primed
process (activations saved for backward, temporaries, gradients in flight, allocator slack).
The peak is the process's high-water mark, so a setup spike above the baseline would count
in it; setup here is small (parameters of a few MiB, a 16-token step), so the delta is the
measured work's.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
RESULT_MARKER = "BENCH_RESULT "
CONFIGS: dict[str, dict[str, int]] = {
    "a": dict(n_layer=4, n_embd=128, n_head=4, mlp_internal_dim_multiplier=16),
    "b": dict(n_layer=6, n_embd=256, n_head=4, mlp_internal_dim_multiplier=32),
}
"""The benchmark model shapes: (a) L4 D128 H4 x16 and (b) L6 D256 H4 x32 (BDHConfig fields)."""


# --------------------------------------------------------------------- worker side
def rss_mib() -> float:
    """Current resident set size of this process, MiB."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MIB


def peak_rss_mib() -> float:
    """Peak resident set size of this process's program, MiB: /proc/self/status VmHWM on
    Linux. (ru_maxrss would not do: Linux carries it over fork and exec, so a worker started by
    a parent holding 9 GiB reports at least 9 GiB.) Elsewhere ru_maxrss (KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def settle_baseline() -> float:
    """Collect garbage, hand free heap pages back to the OS, return the RSS baseline (MiB)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mib()


def emit(result: dict[str, Any]) -> None:
    """The worker's answer to `run_worker`: one marked JSON line on stdout."""
    print(RESULT_MARKER + json.dumps(result), flush=True)


def worker_spec(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The JSON spec when this process was started as a worker (`--worker JSON`), else None."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--worker":
        return json.loads(argv[1])
    return None


# --------------------------------------------------------------------- parent side
def run_worker(script: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run `script --worker <spec>` in a fresh interpreter; its emitted dict, or an error dict.

    Threads are pinned through the environment too, so thread pools created before the
    worker's own torch.set_num_threads cannot oversubscribe.
    """
    threads = str(spec.get("threads", 2))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, script, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout_s:.0f} s"}
    wall = time.perf_counter() - started
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER) :])
            result["process_wall_s"] = wall
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"worker failed (rc={proc.returncode}): {tail[0][:120]}"}


def cpu_counters() -> tuple[float, float, float]:
    """(machine busy CPU-seconds, machine total CPU-seconds, this process's CPU-seconds)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    own = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(ticks) - idle) / hz, sum(ticks) / hz, own.ru_utime + own.ru_stime


def others_cpu_share(before: tuple[float, float, float], after: tuple[float, float, float]):
    """Share of the machine's CPU capacity used by OTHER processes between two cpu_counters().

    0 means the measurement had the cores to itself; 0.5 on 2 cores means another process
    kept one core busy (a 2-thread step then runs at the pace of its slowed thread).
    """
    busy = after[0] - before[0]
    total = after[1] - before[1]
    own = after[2] - before[2]
    return max(0.0, busy - own) / total if total > 0 else 0.0


def others_busy_now(sample_s: float = 2.0) -> float:
    """others_cpu_share over the next `sample_s` seconds (this process idle meanwhile)."""
    before = cpu_counters()
    time.sleep(sample_s)
    return others_cpu_share(before, cpu_counters())


def wait_for_quiet(max_wait_s: float, threshold: float = 0.15) -> float:
    """Sleep until other processes use under `threshold` of the CPUs, at most max_wait_s.

    Returns the last sampled share (also when it gave up waiting)."""
    deadline = time.monotonic() + max_wait_s
    share = others_busy_now()
    while share > threshold and time.monotonic() < deadline:
        time.sleep(8.0)
        share = others_busy_now()
    return share


def load_average() -> float:
    """1-minute load average (other processes share this machine's cores)."""
    return os.getloadavg()[0]


def machine_line() -> str:
    """One line describing the machine and its current load, for the record."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        total_kib = int(f.readline().split()[1])
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {total_kib / (1 << 20):.0f} GiB RAM, "
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
        f"load average {load}"
    )


def matmul_gflops(threads: int = 2, size: int = 2048, repeats: int = 3) -> float:
    """fp32 matmul throughput of this machine right now, best of `repeats` (time estimates)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best / 1e9


def document_starts(batch: int, seq_len: int, per_row: int, device):
    """[B, T] bool: `per_row` documents begin inside each row, at seeded positions (what
    `training.stream_documents = "corpus"` gives the model)."""
    import torch

    draws = torch.Generator().manual_seed(1)
    starts = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row in range(batch):
        starts[row, torch.randint(1, seq_len, (per_row,), generator=draws)] = True
    return starts.to(device)


def timed_train_step(
    model, optimizer, inputs, targets, autocast_dtype=None, reset_mask=None
) -> float:
    """Seconds of one plain train step: forward with the mean loss (under autocast to
    `autocast_dtype` when given; `reset_mask` [B, T]: documents starting inside the rows),
    backward, optimizer step, gradients dropped (on a CUDA device, from an idle device to the
    step's last kernel)."""
    import torch

    cuda = inputs.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(inputs.device)
    autocast = (
        contextlib.nullcontext()
        if autocast_dtype is None
        else torch.autocast(inputs.device.type, dtype=autocast_dtype)
    )
    started = time.perf_counter()
    with autocast:
        if reset_mask is None:
            _, loss = model(inputs, targets)
        else:
            hidden = model.forward_hidden(inputs, reset_mask=reset_mask)
            loss = model.loss_from_hidden(hidden, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(inputs.device)
    return time.perf_counter() - started


# --------------------------------------------------------------------- tables
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown pipe table (pastes into docs as is): text columns left, numbers right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    left = [any(r[i][:1].isalpha() for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if lft else v.rjust(w)
            for v, w, lft in zip(values, widths, left, strict=True)
        ]
        return "| " + " | ".join(parts) + " |"

    rule = "|".join(
        ("-" * (w + 2)) if lft else ("-" * (w + 1) + ":")
        for w, lft in zip(widths, left, strict=True)
    )
    return "\n".join([line(headers), "|" + rule + "|", *(line(r) for r in cells)])


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(f"\n{title}\n")
    print(format_table(headers, rows), flush=True)


def fmt(value: float | None, spec: str = ".0f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)
