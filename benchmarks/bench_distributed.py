"""Tokens per second and the share of step time spent in communication, for 1, 2 and 4
processes: data parallel, pipeline parallel and a 2 x 2 data x pipeline mesh.

Each layout runs the trainer in that many spawned processes joined in one gloo group (one CPU
thread each) for `--steps` optimizer steps of config (a) (L4 D128 H4 x16, fp32) on the
builtin corpus. Timing covers steps 2..N (step 1 warms up). Communication time is the wall
time each process spends inside torch.distributed calls (all-reduce, broadcast, all-gather,
barrier) and waiting for the pipeline's sends and receives, so it includes waiting for a
slower process; the share is its mean over processes divided by the steps' time.

These are CPU figures: on a 2-core machine 4 processes share 2 cores, so more processes mean
less compute each; the point is the relative cost of each layout's communication, not speed.

    python benchmarks/bench_distributed.py [--steps 6] [--block 128] [--batch 8]
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CONFIGS  # noqa: E402

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "data parallel x2": (2, []),
    "data parallel x4": (4, []),
    "pipeline x2": (2, ["parallel.pipeline_stages=2", "parallel.microbatches=2"]),
    "mesh 2 dp x 2 pp": (
        4,
        ["parallel.pipeline_stages=2", "parallel.data_parallel=2", "parallel.microbatches=2"],
    ),
}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather_object", "barrier")


def _timed(record: list[tuple[float, float]], fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append((start, time.perf_counter() - start))

    return wrapper


def _worker(rank: int, world: int, store: str, overrides: list[str], out: str) -> None:
    from torch.distributed.pipelining import schedules

    from bdh_train.config import load_config
    from bdh_train.distributed.env import DistContext
    from bdh_train.train.window import StepWindow
    from bdh_train.training.trainer import Trainer

    torch.set_num_threads(1)
    comm: list[tuple[float, float]] = []
    steps_done: list[float] = []
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
        for name in COLLECTIVES:
            setattr(dist, name, _timed(comm, getattr(dist, name)))
        schedules._wait_batch_p2p = _timed(comm, schedules._wait_batch_p2p)
    original_step = StepWindow.optimizer_step

    def optimizer_step(self):
        row = original_step(self)
        steps_done.append(time.perf_counter())
        return row

    StepWindow.optimizer_step = optimizer_step
    cfg = load_config(overrides=overrides)
    ctx = DistContext(rank, world, rank) if world > 1 else None
    trainer = Trainer(cfg, Path(out, "run"), stream=io.StringIO(), dist_ctx=ctx)
    trainer.run()
    first, last = steps_done[0], steps_done[-1]
    in_steps = sum(d for start, d in comm if first < start < last)
    per_step = cfg.training.batch_size * cfg.training.block_size * trainer.accumulation_steps
    torch.save(
        {"seconds": last - first, "comm": in_steps, "tokens": per_step * (len(steps_done) - 1)},
        Path(out, f"rank{rank}.pt"),
    )
    if world > 1:
        dist.destroy_process_group()


def measure(layout: str, args: argparse.Namespace) -> dict[str, float]:
    processes, extra = LAYOUTS[layout]
    model = [f"model.{key}={value}" for key, value in CONFIGS["a"].items()]
    overrides = [
        *model,
        "model.dropout=0.0",
        f"training.block_size={args.block}",
        f"training.batch_size={args.batch}",
        f"training.max_steps={args.steps}",
        "training.log_every=1",
        "training.eval_every=0",
        "training.checkpoint_every=0",
        # every block from a fresh state, as these layouts were measured (and a pipeline
        # stage keeps no state between steps, so it refuses the tiny preset's streaming)
        "training.tbptt_persist_across_steps=false",
        "training.min_logical_block_size=0",
        *extra,
    ]
    with tempfile.TemporaryDirectory() as out:
        store = os.path.join(out, "store")
        mp.start_processes(
            _worker,
            args=(processes, store, overrides, out),
            nprocs=processes,
            start_method="spawn",
        )
        results = [torch.load(Path(out, f"rank{r}.pt")) for r in range(processes)]
    seconds = max(r["seconds"] for r in results)
    share = sum(r["comm"] / r["seconds"] for r in results) / processes
    return {"processes": processes, "tok_s": results[0]["tokens"] / seconds, "comm": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(
        f"config (a) L4 D128 H4 x16, fp32, batch {args.batch} x {args.block} tokens, steps 2.."
        f"{args.steps} timed, gloo on CPU, one thread per process ({os.cpu_count()} cores)"
    )
    print("| layout | processes | tokens/s | time in communication |\n|---|---|---|---|")
    for layout in LAYOUTS:
        r = measure(layout, args)
        print(f"| {layout} | {r['processes']} | {r['tok_s']:,.0f} | {r['comm']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
