"""The host allocator policy: 'retain' makes a freed large block serve the next request of
its size without the kernel mapping fresh pages; 'auto' resolves by device and C library."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bdh_train.train import allocator
from bdh_train.train.allocator import glibc_malloc, resolve_host_allocator

# In a fresh process (the policy is process-wide): page faults of allocating, filling and
# freeing a 64 MiB tensor, after one such round primed the allocator, before and after
# 'retain'. 64 MiB is 16384 pages of 4 KiB, above glibc's largest mmap threshold (32 MiB).
# The module is loaded by its path in a bare interpreter (no torch: quick to start).
_FAULTS_SCRIPT = """
import ctypes, importlib.util, resource, sys, types
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20

def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_one_round()
system = faults_of_one_round()
mode = allocator.configure_host_allocator("retain", types.SimpleNamespace(type="cpu"))
faults_of_one_round()
print(mode, system, faults_of_one_round())
"""


@pytest.mark.skipif(glibc_malloc() is None, reason="the policy only exists for glibc's malloc")
def test_retain_reuses_freed_pages_instead_of_faulting_them_in_again():
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_SCRIPT, allocator.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    mode, system_faults, retained_faults = out[0], int(out[1]), int(out[2])
    assert mode == "retain"
    assert system_faults >= 16384  # every page of the block mapped anew
    assert retained_faults < 1000  # the freed block reused: its pages are already mapped


def test_auto_retains_only_for_cpu_training_under_glibc():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    expected_cpu = "retain" if glibc_malloc() is not None else "system"
    assert resolve_host_allocator("auto", cpu) == expected_cpu
    assert resolve_host_allocator("auto", cuda) == "system"
    assert resolve_host_allocator("system", cpu) == "system"
    assert resolve_host_allocator("retain", cuda) == "retain"
    assert resolve_host_allocator("auto", cpu, saving_memory=True) == "system"
    assert resolve_host_allocator("retain", cpu, saving_memory=True) == "retain"


@pytest.mark.parametrize(
    ("mode", "recompute"), [("system", "none"), ("auto", "none"), ("auto", "layer")]
)
def test_the_trainer_applies_the_configured_policy(tmp_path, mode, recompute):
    from bdh_train.config import load_config
    from bdh_train.training.trainer import Trainer

    overrides = [
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=1",
        "model.mlp_internal_dim_multiplier=2",
        "training.block_size=8",
        "training.batch_size=2",
        "training.device='cpu'",
        f"training.host_allocator='{mode}'",
        f"training.recompute='{recompute}'",
    ]
    trainer = Trainer(load_config(overrides=overrides), tmp_path / "run")
    cpu = torch.device("cpu")
    assert trainer.host_allocator == resolve_host_allocator(mode, cpu, recompute != "none")
