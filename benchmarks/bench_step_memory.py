"""Train-step memory: the estimate `bdh-train train` checks before allocating (train/memory.py)
against measured peaks, for a grid of configs (executors, recompute modes, TBPTT, dropout,
autocast, a wide vocabulary, a model whose peak is the optimizer step).

Each row runs the trainer's own components (`build_model`, `build_executor`, the
accumulator, `StepWindow` with AdamW, or Muon in the rows named so) for two optimizer steps,
the first on a 16-token slice (so the optimizer's state exists during the second one's
backward), in two fresh processes:

* **tensors**: under torch's profiler with profile_memory=True, started before the model is
  built; the CPU allocator's allocation and free events, summed in time order, peak at the
  most bytes torch's tensors held at once. This is what the estimate counts (what
  tests/train/test_memory.py checks, within 25%). On CUDA: torch.cuda.max_memory_allocated.
* **RSS**: without the profiler, with the host allocator the trainer would set
  (`training.host_allocator = 'auto'`: 'retain' without recompute, else 'system'), after the
  same two steps on one row of 16 tokens (libtorch's code paged in, thread pools made, then
  everything freed and trimmed); delta = peak RSS (VmHWM) - RSS before the model was built
  (see _common.py): the tensors plus what glibc's heap holds besides them (freed blocks it
  keeps; 'retain' keeps them all).

Config (a) is L4 D128 H4 x16 (N=512), (b) L6 D256 H4 x32 (N=2048), vocab 256, dropout 0, rope,
unless the row says otherwise; fp32; executor 'auto' (the column names what it ran).

Run: .venv/bin/python benchmarks/bench_step_memory.py [--rows NAME ...] [--device cpu|cuda]
     [--no-rss] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from _common import (
    CONFIGS,
    MIB,
    emit,
    machine_line,
    peak_rss_mib,
    print_table,
    run_worker,
    settle_baseline,
    worker_spec,
)

PRIMER_TOKENS = 16
A, B = CONFIGS["a"], CONFIGS["b"]
GRID: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "(a) B8 T512": (A, dict(batch_size=8, block_size=512)),
    "(a) B8 T512 mixer": (A, dict(batch_size=8, block_size=512, recompute="mixer")),
    "(a) B8 T512 layer": (A, dict(batch_size=8, block_size=512, recompute="layer")),
    "(a) B4 T2048": (A, dict(batch_size=4, block_size=2048)),
    "(a) B4 T2048 layer": (A, dict(batch_size=4, block_size=2048, recompute="layer")),
    "(a) B8 T2048 tbptt 256 x2": (
        A,
        dict(batch_size=8, block_size=2048, tbptt_chunk_size=256, tbptt_backprop_chunks=2),
    ),
    "(a) B8 T512 accum 2": (
        A,
        dict(batch_size=8, block_size=512, gradient_accumulation_steps=2),
    ),
    "(a) B8 T512 alibi dropout": (
        dict(A, position="alibi", dropout=0.1),
        dict(batch_size=8, block_size=512),
    ),
    "(a) B8 T512 bf16": (A, dict(batch_size=8, block_size=512, dtype="bfloat16")),
    "(a) B4 T512 vocab 32768": (dict(A, vocab_size=32768), dict(batch_size=4, block_size=512)),
    "(b) B4 T512": (B, dict(batch_size=4, block_size=512)),
    "(b) B2 T2048": (B, dict(batch_size=2, block_size=2048)),
    "(b) B1 T64": (B, dict(batch_size=1, block_size=64)),
    "(a) B8 T512 muon": (A, dict(batch_size=8, block_size=512)),
    "(b) B1 T64 muon": (B, dict(batch_size=1, block_size=64)),
}
"""Row name -> (BDHConfig fields, TrainingConfig fields)."""
MUON_ROWS = frozenset(row for row in GRID if row.endswith(" muon"))
"""The rows that train with optimizer.name = 'muon' (the others with AdamW)."""


def worker(spec: dict[str, Any]) -> None:
    import torch

    from bdh_train.batch import SequenceBatch
    from bdh_train.model import BDHConfig
    from bdh_train.train.allocator import configure_host_allocator
    from bdh_train.train.config import TrainingConfig
    from bdh_train.train.memory_estimate import estimate_step_memory

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    model_fields, training_fields = GRID[spec["row"]]
    model = BDHConfig(**{"vocab_size": 256, "dropout": 0.0, **model_fields})
    training = TrainingConfig(max_steps=2, device=spec["device"], **training_fields).validate()
    optimizer = "muon" if spec["row"] in MUON_ROWS else "adamw"
    estimate = estimate_step_memory(model, training, device.type, optimizer=optimizer)
    g = torch.Generator().manual_seed(0)
    shape = (training.batch_size, training.block_size + 1)
    tokens = torch.randint(0, model.vocab_size, shape, generator=g).to(device)
    batch = SequenceBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    result: dict[str, Any] = {
        "estimate": estimate.total,
        "activations": estimate.activations,
        "executor": estimate.executor,
        "at": estimate.at,
    }
    if spec["mode"] == "rss":
        result["allocator"] = configure_host_allocator(
            spec["host_allocator"], device, saving_memory=training.recompute != "none"
        )
        primer = batch.rows(0, 1).time_slice(0, PRIMER_TOKENS)
        two_steps(model, training, device, primer, optimizer)
        base = settle_baseline()  # code paged in, pools made above
        two_steps(model, training, device, batch, optimizer)
        result["rss_delta"] = (peak_rss_mib() - base) * MIB
    elif device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        two_steps(model, training, device, batch, optimizer)
        torch.cuda.synchronize()
        result["tensors"] = torch.cuda.max_memory_allocated(device) - start
    else:
        result["tensors"] = profiled_peak(
            lambda: two_steps(model, training, device, batch, optimizer)
        )
    emit(result)


def two_steps(model: Any, training: Any, device: Any, batch: Any, optimizer: str = "adamw") -> None:
    """Two optimizer steps of the trainer's own components (`build_model`, `build_executor`,
    the accumulator, `StepWindow` with the optimizer named `optimizer`) on `batch`, the first
    on its first PRIMER_TOKENS tokens, so the optimizer's state exists during the second
    step's backward (tests/train/test_memory.py measures the same)."""
    import torch

    from bdh_train.distributed.config import ParallelConfig
    from bdh_train.distributed.env import DistContext
    from bdh_train.train.accumulate import WeightedGradientAccumulator
    from bdh_train.train.build import build_executor, build_model
    from bdh_train.train.optim import OptimizerConfig
    from bdh_train.train.schedules import GradientScaleSchedule
    from bdh_train.train.state import TrainerState
    from bdh_train.train.window import StepWindow, reduction_for

    bdh = build_model(model, training, device, optimizer=optimizer)
    scales = GradientScaleSchedule(bdh)
    executor, group = build_executor(
        bdh, training, ParallelConfig(), DistContext(), device, scales, None
    )
    accumulator = WeightedGradientAccumulator(bdh, torch.float32)
    optim = OptimizerConfig(name=optimizer)
    window = StepWindow(
        bdh,
        reduction_for(executor, accumulator, bdh, group),
        optim.build(bdh),
        scales,
        TrainerState(),
        optim,
        training,
        log=print,
        last_good=str,
    )
    for piece in (batch.time_slice(0, PRIMER_TOKENS), batch):
        for _ in range(training.accumulation_steps):
            window.micro_step(lambda piece=piece: piece)
        window.optimizer_step()


def profiled_peak(run) -> int:
    """The most bytes the CPU allocator had handed out at once while `run()` ran: its
    allocation and free events under torch's profiler, summed in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events: list[tuple[int, int]] = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(GRID), choices=list(GRID), metavar="ROW")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-rss", action="store_true", help="measure the tensors' peak only")
    ap.add_argument(
        "--host-allocator",
        default="auto",
        choices=("auto", "retain", "system"),
        help="training.host_allocator of the RSS runs",
    )
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    table = []
    for row in args.rows:
        spec = {
            "row": row,
            "device": args.device,
            "threads": args.threads,
            "mode": "tensors",
            "host_allocator": args.host_allocator,
        }
        r = run_worker(os.path.abspath(__file__), spec, timeout_s=args.timeout_s)
        if "error" in r:
            print(f"{row}: {r['error']}", flush=True)
            table.append((row, r["error"], "", "", "", "", "", "", ""))
            continue
        rss = {"rss_delta": None, "allocator": "-"}
        if not args.no_rss and args.device == "cpu":
            rss = run_worker(os.path.abspath(__file__), dict(spec, mode="rss"), args.timeout_s)
        error = 100 * (r["estimate"] - r["tensors"]) / r["tensors"]
        delta = rss.get("rss_delta")
        print(
            f"{row}: estimate {r['estimate'] / MIB:.0f} MiB, measured "
            f"{r['tensors'] / MIB:.0f} MiB ({error:+.1f}%)",
            flush=True,
        )
        table.append(
            (
                row,
                r["executor"],
                r["at"],
                f"{r['estimate'] / MIB:.0f}",
                f"{r['activations'] / MIB:.0f}",
                f"{r['tensors'] / MIB:.0f}",
                f"{error:+.1f}",
                "-" if delta is None else f"{delta / MIB:.0f} ({rss.get('allocator', '-')})",
                "-" if delta is None else f"{delta / r['estimate']:.2f}",
            )
        )
    print_table(
        f"train-step memory on {args.device}, fp32 unless the row says bf16, {args.threads} "
        "threads. estimate: train/memory.py's whole step (activations: its activation part); "
        "tensors: the measured peak of torch's tensors over two optimizer steps (the CPU "
        "allocator's events under the profiler; CUDA: max_memory_allocated); error = "
        "(estimate - tensors) / tensors; RSS delta: peak RSS - RSS before the model was built, "
        f"with training.host_allocator = '{args.host_allocator}' (the policy it took in brackets)",
        (
            "config",
            "executor",
            "peak at",
            "estimate MiB",
            "activations MiB",
            "tensors MiB",
            "error %",
            "RSS delta MiB (allocator)",
            "RSS / estimate",
        ),
        table,
    )


if __name__ == "__main__":
    _spec = worker_spec()
    if _spec is not None:
        worker(_spec)
    else:
        main()
