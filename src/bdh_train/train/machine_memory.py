"""The memory this process may still allocate: a CUDA device's total, or on the CPU the least
of the address-space limit, the memory cgroup's headroom and the machine's physical memory
less this process's resident set."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
"""Where the memory cgroups are mounted, and the file naming this process's groups."""
UNLIMITED_CGROUP = 1 << 62
"""cgroup v1 reports "no limit" as a number near 2^63."""


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes a train step may still allocate, and where that figure comes from."""

    bytes: int
    source: str


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 when it cannot be read)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_headroom() -> int | None:
    """The least (limit - working set) over this process's memory cgroup and its ancestors,
    None where no limit is set. The working set is the usage (v2: memory.current; v1:
    memory.usage_in_bytes) less the inactive file cache (memory.stat's inactive_file; v1:
    total_inactive_file), which the kernel reclaims when a process needs memory, as kubelet
    and docker count it."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base, limit_file, usage_file = CGROUP_ROOT, "memory.max", "memory.current"
            cache = "inactive_file"
        elif "memory" in controllers.split(","):
            base = CGROUP_ROOT / "memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache = "total_inactive_file"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = base.joinpath(*parts[:depth])
            limit = _read_int(directory / limit_file)  # 'max' (no limit) reads as None
            usage = _read_int(directory / usage_file)
            if limit is not None and usage is not None and limit < UNLIMITED_CGROUP:
                reclaimable = _stat_value(directory / "memory.stat", cache)
                found.append(limit - max(usage - reclaimable, 0))
    return min(found) if found else None


def available_memory(device: torch.device) -> AvailableMemory:
    """What a train step on `device` may allocate: a CUDA device's total memory; on the CPU
    the least of this process's address-space limit (RLIMIT_AS) less what it has mapped, its
    memory cgroup's limit less the group's usage, and the machine's physical memory less
    this process's resident set."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return AvailableMemory(total, "the GPU's memory")
    options: list[AvailableMemory] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = (_proc_status_kib("VmSize") or 0) * 1024
        options.append(
            AvailableMemory(soft - mapped, "this process's address-space limit (ulimit -v)")
        )
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        options.append(AvailableMemory(cgroup, "its cgroup's memory limit"))
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every platform reports it
        physical = None
    if physical is not None:
        resident = (_proc_status_kib("VmRSS") or 0) * 1024
        options.append(AvailableMemory(physical - resident, "this machine's memory"))
    if not options:
        return AvailableMemory(-1, "unknown")
    return min(options, key=lambda option: option.bytes)
