"""The host memory allocator's policy for a training process.

glibc's malloc serves every request above its mmap threshold (at most 32 MiB) with a fresh
mmap and returns it with munmap when freed. A train step allocates and frees activations of
tens to hundreds of MiB, so each step maps them anew and the kernel zero-fills every page on
its first touch: on a 2-core CPU, config L4 D128 H4 N512 at T=2048 B=8 spent 16 of 45 CPU
seconds per three steps in the kernel (1.4M minor page faults per step), and ran 1.65-1.8x
faster once freed memory was kept for reuse (docs/benchmarks.md, "Host allocator").

'retain' tells malloc to serve large requests from its heap (no mmap) and never to hand the
heap's free top back to the kernel, so the second step reuses the first step's pages. The
process's resident memory then stays at its peak instead of shrinking between steps, and that
peak is higher, the heap holding freed blocks between the live ones: 7.3 GiB instead of
4.2 GiB at T=2048 B=8 (for 1.77x the speed). So 'auto' does not retain for a run that asked
for less memory (training.recompute).
"""

from __future__ import annotations

import ctypes
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imports nothing else at run time, so a bare process can load it
    import torch

HOST_ALLOCATORS = ("auto", "retain", "system")

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # the largest value an int parameter takes: the heap top stays mapped


def glibc_malloc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (the one whose mallopt is known), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def resolve_host_allocator(mode: str, device: torch.device, saving_memory: bool = False) -> str:
    """'retain' or 'system' for a requested mode. 'auto' retains for CPU training under glibc,
    where activations live in host memory, unless the run is `saving_memory` (it recomputes
    activations to need less); on an accelerator the host side is not hot (CUDA has its own
    caching allocator), and other C libraries keep their default."""
    if mode != "auto":
        return mode
    if saving_memory or device.type != "cpu" or glibc_malloc() is None:
        return "system"
    return "retain"


def configure_host_allocator(mode: str, device: torch.device, saving_memory: bool = False) -> str:
    """Apply the policy to this whole process and return the one in effect.

    'retain' without glibc cannot be applied and leaves the allocator as it is ('system' is
    returned). The setting lasts for the life of the process.
    """
    effective = resolve_host_allocator(mode, device, saving_memory)
    if effective != "retain":
        return "system"
    libc = glibc_malloc()
    if libc is None:
        return "system"
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)):
        return "system"  # mallopt reports failure with 0
    return "retain"
