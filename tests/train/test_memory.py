"""The train step's memory estimate (train/memory.py): against measured peaks, the refusal
before anything is allocated, what is available, and `bdh-train plan --memory`.

How the peak is measured: the trainer's own components (`build_model`, `build_executor`,
the accumulator, `StepWindow` with AdamW, or Muon) run two optimizer steps (the first on a
16-token slice, so that the optimizer's state exists during the second one's backward, as in
every later step) under torch's profiler with `profile_memory=True`, started before the
model is built.
The CPU allocator reports every allocation and free with its size; their running sum in
time order peaks at the most bytes torch's tensors held at once (parameters, gradients,
the optimizer's state, the accumulator's sums, activations and every temporary), the same to the
byte on every run. The resident set would add the host allocator's slack (glibc's heap keeps
freed blocks, more or less by allocation order and `training.host_allocator`), which the
estimate does not count: benchmarks/bench_step_memory.py prints both.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from pathlib import Path

import pytest
import torch

from bdh_train.batch import SequenceBatch
from bdh_train.cli import main
from bdh_train.errors import ConfigError
from bdh_train.model import BDHConfig
from bdh_train.train import build, machine_memory, memory_check
from bdh_train.train import memory_estimate as memory
from bdh_train.train.config import (
    ONEDNN_ISA_CAPS,
    TrainingConfig,
    cpu_has_bfloat16_tiles,
    onednn_allows_amx,
)
from bdh_train.train.machine_memory import AvailableMemory
from bdh_train.train.memory_check import check_step_memory
from bdh_train.train.memory_estimate import GIB, MIB, estimate_step_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_step_memory  # noqa: E402  (two_steps and profiled_peak: one measurement for both)

CPU = torch.device("cpu")
SMALL = dict(n_layer=2, n_embd=64, n_head=4, mlp_internal_dim_multiplier=16, dropout=0.0)
"""N = 256 neurons a head: dense up to T = 402 on the CPU, chunked/128 beyond."""


def measured_step_peak(model: BDHConfig, training: TrainingConfig, optimizer: str) -> int:
    """Bytes torch held at the peak of a train step (the module docstring says how): the
    benchmark's two optimizer steps under torch's profiler."""
    g = torch.Generator().manual_seed(0)
    shape = (training.batch_size, training.block_size + 1)
    tokens = torch.randint(0, model.vocab_size, shape, generator=g)
    batch = SequenceBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return bench_step_memory.profiled_peak(
        lambda: bench_step_memory.two_steps(model, training, CPU, batch, optimizer)
    )


CASES = {
    "dense": (SMALL, dict(batch_size=4, block_size=256)),
    "chunked, recompute mixer": (SMALL, dict(batch_size=2, block_size=768, recompute="mixer")),
    "tbptt, recompute layer, accumulation": (
        SMALL,
        dict(
            batch_size=4,
            block_size=128,
            tbptt_chunk_size=64,
            tbptt_backprop_chunks=2,
            gradient_accumulation_steps=2,
            recompute="layer",
        ),
    ),
    "wide model, short block": (
        dict(SMALL, n_embd=256, mlp_internal_dim_multiplier=32),
        dict(batch_size=1, block_size=64),
    ),
    "wide model, short block, muon": (
        dict(SMALL, n_embd=256, mlp_internal_dim_multiplier=32),
        dict(batch_size=1, block_size=64),
    ),
}
"""Measured (fp32, torch 2.13 on the CPU): 57.8, 75.2, 18.3, 154.8 and 130.8 MiB; estimated
59.8, 77.4, 18.9, 155.0 and 131.0. The last two peak at the optimizer step (their parameters,
gradients, sums and the optimizer's state outweigh their activations); Muon keeps one buffer
for the encoders and the decoder where AdamW keeps two moments."""
EXPECTED = {
    "dense": ("dense", "backward"),
    "chunked, recompute mixer": ("chunked/128", "backward"),
    "tbptt, recompute layer, accumulation": ("dense", "backward"),
    "wide model, short block": ("dense", "the optimizer step"),
    "wide model, short block, muon": ("dense", "the optimizer step"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_is_within_a_quarter_of_the_measured_step(case):
    """The whole step (parameters, gradients, the accumulator, the optimizer's state, activations
    and temporaries at the peak), estimated before the model exists, against the measured
    peak of the trainer's components."""
    model_fields, training_fields = CASES[case]
    optimizer = "muon" if case.endswith("muon") else "adamw"
    model = BDHConfig(**model_fields)
    training = TrainingConfig(max_steps=2, **training_fields).validate()
    estimate = estimate_step_memory(model, training, "cpu", optimizer=optimizer)
    measured = measured_step_peak(model, training, optimizer)
    assert (estimate.executor, estimate.at) == EXPECTED[case]
    assert measured > 10 * MIB
    assert abs(estimate.total - measured) / measured <= 0.25, (estimate, measured / MIB)


def test_the_estimate_adds_up_and_follows_the_settings():
    model = BDHConfig(**SMALL)
    training = TrainingConfig(batch_size=4, block_size=256).validate()
    plain = estimate_step_memory(model, training, "cpu")
    count = model.parameter_count()
    assert (plain.parameters, plain.gradients, plain.optimizer) == (4 * count, 4 * count, 8 * count)
    assert plain.total == plain.parameters + plain.gradients + plain.optimizer + plain.activations
    twice = estimate_step_memory(model, dataclasses.replace(training, batch_size=8), "cpu")
    assert 1.9 < twice.activations / plain.activations <= 2.0
    saving = [
        estimate_step_memory(model, dataclasses.replace(training, recompute=mode), "cpu")
        for mode in ("mixer", "layer")
    ]
    assert plain.activations > saving[0].activations > saving[1].activations
    accumulating = dataclasses.replace(training, gradient_accumulation_steps=2)
    assert estimate_step_memory(model, accumulating, "cpu").gradients == 2 * plain.gradients
    # Muon: one buffer for the encoders and the decoder (3 x 4 x 64 x 256 = 196,608 floats),
    # AdamW's two moments for the rest
    muon = estimate_step_memory(model, training, "cpu", optimizer="muon")
    assert muon.optimizer == 4 * (196_608 + 2 * (count - 196_608))
    assert (muon.parameters, muon.activations) == (plain.parameters, plain.activations)
    weights_only = BDHConfig(**dict(SMALL, n_embd=256, mlp_internal_dim_multiplier=32))
    largest = 4 * 256 * 2048  # encoder [H, D, N], the size of decoder [H N, D]
    assert memory.optimizer_memory(weights_only, "muon", 4)[1] == 6 * 4 * largest
    assert memory.optimizer_memory(weights_only, "adamw", 4)[1] == 4 * largest
    short = TrainingConfig(batch_size=1, block_size=64).validate()
    adamw_step = estimate_step_memory(weights_only, short, "cpu")
    muon_step = estimate_step_memory(weights_only, short, "cpu", optimizer="muon")
    assert adamw_step.at == muon_step.at == "the optimizer step"
    # at the step, the accumulator's two float32 sums (2 x 4 x 6,422,528 bytes) and a float32
    # temporary outweigh Muon's 6 matrices: the gradients' part is the same
    assert muon_step.gradients == adamw_step.gradients == 4 * (3 * 6_422_528 + largest)


def huge() -> tuple[BDHConfig, TrainingConfig]:
    """The issue's case: n_embd 2048, multiplier 32 on the tiny preset's training shape."""
    model = BDHConfig(n_layer=4, n_embd=2048, n_head=4, mlp_internal_dim_multiplier=32)
    return model, TrainingConfig(batch_size=16, block_size=128).validate()


def test_a_step_too_large_is_refused_with_the_figure_and_what_would_fit():
    model, training = huge()
    room = AvailableMemory(12 * GIB, "a test's limit")
    estimate = estimate_step_memory(model, training, "cpu")
    with pytest.raises(ConfigError) as refused:
        check_step_memory(model, training, CPU, available=room)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"a train step needs {estimate.summary()}, at its peak in backward")
    assert (
        "; this process has 12.0 GiB available (a test's limit): lower training.batch_size to "
        in (message)
    )
    batch = int(message.split("lower training.batch_size to ")[1].split(",")[0])
    fitting = dataclasses.replace(training, batch_size=batch)
    assert estimate_step_memory(model, fitting, "cpu").total <= 12 * GIB
    over = dataclasses.replace(training, batch_size=batch + 1)
    assert estimate_step_memory(model, over, "cpu").total > 12 * GIB
    assert message.endswith(f"to {batch}, or set training.recompute = 'layer'")
    layer = dataclasses.replace(training, recompute="layer")
    assert estimate_step_memory(model, layer, "cpu").total <= 12 * GIB


def test_weights_that_alone_do_not_fit_name_the_model_key():
    """The issue's case under 5 GiB: its weights, gradients and moments alone need 6 GiB."""
    model, training = huge()
    with pytest.raises(ConfigError) as refused:
        check_step_memory(model, training, CPU, available=AvailableMemory(5 * GIB, "a limit"))
    assert str(refused.value) == (
        "model.mlp_internal_dim_multiplier=32 (with model.n_embd=2048, model.n_head=4) makes a "
        "model of 4.04e+08 parameters, more than this process's 5.0 GiB available (a limit) "
        "holds for training (the parameters, their gradients, AdamW's two moments: 6.0 GiB); "
        "lower model.mlp_internal_dim_multiplier"
    )


def test_train_refuses_before_the_model_is_allocated(tmp_path, capsys, monkeypatch):
    """`bdh-train train` on the issue's config under a 12 GiB limit: one error line, exit 2,
    nothing in the run directory but the error log, and no model ever built."""

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(
        memory_check, "available_memory", lambda device: AvailableMemory(12 * GIB, "a test's limit")
    )
    monkeypatch.setattr(build, "BDH", no_model)
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), "--set", "model.n_embd=2048"]
    args += ["--set", "model.mlp_internal_dim_multiplier=32", "--set", "training.batch_size=16"]
    code = main([*args, "--set", "training.device='cpu'"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    from bdh_train.config import load_config

    cfg = load_config([], [*args[4::2], "training.device='cpu'"]).resolved()
    muon = estimate_step_memory(cfg.model, cfg.training, "cpu", optimizer="muon")  # the preset's
    assert err.startswith(f"error: a train step needs {muon.summary()}, at its peak in ")
    assert "this process has 12.0 GiB available (a test's limit): lower training.batch_size" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["error.log"]


def test_plan_prints_the_estimate_and_the_verdict(capsys, monkeypatch):
    monkeypatch.setattr(
        memory_check, "available_memory", lambda device: AvailableMemory(5 * GIB, "a test's limit")
    )
    sets = ["--set", "training.device='cpu'", "--set", "training.batch_size=4"]
    assert main(["plan", "--memory", *sets]) == 0
    out = capsys.readouterr().out
    from bdh_train.config import load_config

    cfg = load_config([], sets[1::2]).resolved()
    assert cfg.optimizer.name == "muon"  # the tiny preset's: the plan counts Muon's state
    estimate = estimate_step_memory(cfg.model, cfg.training, "cpu", optimizer="muon")
    assert out.splitlines()[0] == "a train step's peak memory, estimated (one process, cpu):"
    optimizer = memory.format_bytes(estimate.optimizer)
    assert f"  optimizer   {optimizer:>11}   Muon's momentum (encoders, decoder) and AdamW's" in out
    assert (
        f"  parameters  {memory.format_bytes(estimate.parameters):>11}   458,752 parameters" in out
    )
    total = f"  total       {memory.format_bytes(estimate.total):>11}   at its peak in backward"
    assert total in out
    assert "\nthis process has 5.0 GiB available (a test's limit)\nit fits\n" in out
    wide = ["--set", "model.n_embd=1024", "--set", "training.batch_size=64"]
    assert main(["plan", "--memory", *sets, *wide]) == 0
    cfg = load_config([], [*sets[1::2], *wide[1::2]]).resolved()
    with pytest.raises(ConfigError) as refused:
        check_step_memory(
            cfg.model, cfg.training, CPU, available=AvailableMemory(5 * GIB, "x"), optimizer="muon"
        )
    verdict = f"it does not fit: `bdh-train train` would refuse it ({refused.value})\n"
    assert verdict.replace("(x)", "(a test's limit)") in capsys.readouterr().out


def test_plan_keeps_its_pipeline_options_apart(capsys):
    assert main(["plan", "--memory", "--layers", "4"]) == 2
    assert capsys.readouterr().err == "error: plan --memory reads the run's config; drop --layers\n"
    assert main(["plan", "--layers", "4", "--stages", "2"]) == 2
    assert capsys.readouterr().err == "error: plan needs --microbatches (or --memory)\n"
    assert main(["plan", "--set", "training.batch_size=4"]) == 2
    assert capsys.readouterr().err == "error: --config, --set and --preset go with plan --memory\n"


def test_available_memory_takes_the_address_space_limit(monkeypatch):
    """Under `ulimit -v` the room is the limit less what the process has mapped already."""
    mapped = machine_memory._proc_status_kib("VmSize")
    assert mapped is not None and mapped > 0
    limit = mapped * 1024 + 3 * GIB
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, resource.RLIM_INFINITY))
    monkeypatch.setattr(machine_memory, "_cgroup_headroom", lambda: None)
    room = machine_memory.available_memory(CPU)
    assert room.source == "this process's address-space limit (ulimit -v)"
    assert 2.9 * GIB < room.bytes <= 3 * GIB


@pytest.mark.parametrize("version", [1, 2])
def test_available_memory_takes_the_tightest_cgroup_limit(tmp_path, monkeypatch, version):
    """A limit on the process's cgroup or any group above it, less that group's usage."""
    if version == 2:
        files, membership = ("memory.max", "memory.current"), "0::/outer/inner\n"
        root = tmp_path
    else:
        files, membership = (
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            ("4:memory:/outer/inner\n1:cpu:/\n"),
        )
        root = tmp_path / "memory"
    limits = {"": 2**63 - 4096, "outer": 6 * GIB, "outer/inner": 8 * GIB}
    for group, limit in limits.items():
        directory = root / group
        directory.mkdir(parents=True, exist_ok=True)
        text = "max" if version == 2 and not group else str(limit)
        (directory / files[0]).write_text(text + "\n")
        (directory / files[1]).write_text(f"{GIB}\n")
    (tmp_path / "cgroup").write_text(membership)
    monkeypatch.setattr(machine_memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(machine_memory, "PROC_CGROUP", tmp_path / "cgroup")
    assert machine_memory._cgroup_headroom() == 5 * GIB
    monkeypatch.setattr(resource, "getrlimit", lambda which: (-1, -1))
    room = machine_memory.available_memory(CPU)
    assert (room.bytes, room.source) == (5 * GIB, "its cgroup's memory limit")


@pytest.mark.parametrize("version", [1, 2])
def test_the_cgroup_headroom_counts_inactive_file_cache_as_free(tmp_path, monkeypatch, version):
    """A container that has just installed torch holds gigabytes of page cache in its usage;
    the inactive part is reclaimed when a process needs it, so it is not 'used'."""
    if version == 2:
        names, key, membership = ("memory.max", "memory.current"), "inactive_file", "0::/\n"
        root = tmp_path
    else:
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        key, membership, root = "total_inactive_file", "4:memory:/\n", tmp_path / "memory"
    root.mkdir(exist_ok=True)
    (root / names[0]).write_text(f"{4 * GIB}\n")
    (root / names[1]).write_text(f"{4 * GIB - 100 * MIB}\n")
    (root / "memory.stat").write_text(f"active_file {GIB}\n{key} {3 * GIB}\nanon {MIB}\n")
    (tmp_path / "cgroup").write_text(membership)
    monkeypatch.setattr(machine_memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(machine_memory, "PROC_CGROUP", tmp_path / "cgroup")
    assert machine_memory._cgroup_headroom() == 3 * GIB + 100 * MIB
    (root / "memory.stat").unlink()  # no counters: the usage as it is
    assert machine_memory._cgroup_headroom() == 100 * MIB


@pytest.fixture
def onednn_uncapped(monkeypatch):
    """No oneDNN ISA cap in the environment (the suite sets one below AMX: suite_setup.py)."""
    for cap in ONEDNN_ISA_CAPS:
        monkeypatch.delenv(cap, raising=False)


@pytest.mark.usefixtures("onednn_uncapped")
@pytest.mark.parametrize("amx", [True, False], ids=["cpu-with-amx", "cpu-without"])
@pytest.mark.parametrize("bf16_gpu", [True, False], ids=["cuda-with-bf16", "cuda-without"])
def test_dtype_auto_is_bfloat16_autocast_only_where_products_have_bfloat16_hardware(
    monkeypatch, bf16_gpu, amx
):
    """training.dtype = 'auto' resolves by device: bfloat16 autocast on CUDA with bfloat16
    arithmetic and on a CPU with AMX tiles, float32 on CUDA without it (a GPU that only
    emulates it) and on other CPUs; the memory estimate and its lines follow the resolved
    dtype."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # every CUDA device emulates bfloat16 (V100, T4); only bf16_gpu ones have its arithmetic
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: including_emulation or bf16_gpu,
    )
    model = BDHConfig(**SMALL)
    auto, bf16, fp32 = (
        TrainingConfig(block_size=64, batch_size=4, dtype=d)
        for d in ("auto", "bfloat16", "float32")
    )
    assert [t.bfloat16_autocast("cuda") for t in (auto, bf16, fp32)] == [bf16_gpu, True, False]
    assert [t.bfloat16_autocast("cpu") for t in (auto, bf16, fp32)] == [amx, True, False]
    chosen = "bfloat16 autocast" if bf16_gpu else "float32"  # the banner's words
    assert [t.precision("cuda") for t in (auto, bf16, fp32)] == [
        f"{chosen} (dtype 'auto')",
        "bfloat16 autocast",
        "float32",
    ]
    on_cpu = "bfloat16 autocast" if amx else "float32"
    assert auto.precision("cpu") == f"{on_cpu} (dtype 'auto')"
    same = bf16 if bf16_gpu else fp32
    for device in ("cuda", "cpu"):
        like = same if device == "cuda" else (bf16 if amx else fp32)
        got = estimate_step_memory(model, auto, device)
        assert got == estimate_step_memory(model, like, device)
        lines = memory_check.render_step_memory(got, model, auto, device)
        assert lines == memory_check.render_step_memory(got, model, like, device)
    bf16_step, fp32_step = (estimate_step_memory(model, t, "cuda") for t in (bf16, fp32))
    assert bf16_step != fp32_step


@pytest.mark.usefixtures("onednn_uncapped")
@pytest.mark.parametrize(
    ("env", "allowed"),
    [
        ({}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "default"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX_FP16"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx2"}, False),
        ({"DNNL_MAX_CPU_ISA": "AVX512_CORE"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "DNNL_MAX_CPU_ISA": "AVX2"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX-512"}, True),  # not a level oneDNN knows: no cap
    ],
)
def test_auto_takes_bfloat16_on_a_cpu_with_amx_only_where_onednn_may_use_it(
    monkeypatch, env, allowed
):
    """oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, else the older DNNL_MAX_CPU_ISA) at a level below
    AMX leaves AVX-512's bfloat16 dot products, 0.87x float32's speed: 'auto' is float32
    there. Its level names are read in any case; a name oneDNN does not know caps nothing."""
    assert onednn_allows_amx(env) is allowed
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpu_has_bfloat16_tiles() is allowed
    assert TrainingConfig(dtype="auto").bfloat16_autocast("cpu") is allowed
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu_has_bfloat16_tiles()
