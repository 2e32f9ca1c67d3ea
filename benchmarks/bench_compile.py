"""Eager against compiled (`training.compile`: BDH.compile_layers) train steps of bdh-train,
alternating in one process.

Two models with the same weights (config a or b of _common.CONFIGS, vocab 256, fp32, dropout
0, 2 threads, executor auto, the host allocator as the trainer sets it) and an AdamW each; the
compiled one's first step builds its graph (its time is printed apart); then --rounds rounds
of one eager and one compiled step. tokens/s from the fastest step; the dynamo counters after
the run show how many graphs were built.

Run: .venv/bin/python benchmarks/bench_compile.py [--configs a --grid 512x8,2048x8]
"""

from __future__ import annotations

import argparse

import torch
from _common import CONFIGS, load_average, machine_line, print_table, timed_train_step
from torch._dynamo.utils import counters

from bdh_train.model import BDH, BDHConfig
from bdh_train.train.allocator import configure_host_allocator


def measure(config: str, seq_len: int, batch: int, rounds: int) -> list:
    sides = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = BDH(BDHConfig(**CONFIGS[config], vocab_size=256, dropout=0.0))
        if compiled:
            model.compile_layers()
        sides["compiled" if compiled else "eager"] = (
            model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        )
    x = torch.randint(0, 256, (batch, seq_len))
    y = torch.randint(0, 256, (batch, seq_len))

    def step(side: str) -> float:
        model, optimizer = sides[side]
        return timed_train_step(model, optimizer, x, y)

    load = load_average()
    step("eager")
    first_compiled = step("compiled")
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for side in times:
            times[side].append(step(side))
    eager, compiled = (seq_len * batch / min(times[s]) for s in ("eager", "compiled"))
    return [config, seq_len, batch, f"{eager:.0f}", f"{compiled:.0f}",
            f"{compiled / eager:.2f}x", f"{first_compiled:.0f}", f"{load:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="a")
    ap.add_argument("--grid", default="512x8,2048x8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    allocator = configure_host_allocator("auto", torch.device("cpu"))
    print(f"machine: {machine_line()}; host allocator: {allocator}")
    rows = []
    for config in args.configs.split(","):
        for point in args.grid.split(","):
            seq_len, batch = (int(v) for v in point.split("x"))
            rows.append(measure(config, seq_len, batch, args.rounds))
            print(rows[-1], flush=True)
    print_table(
        "train step tokens/s (fastest of the rounds), eager and compiled alternating; first "
        f"compiled step (graph build) in seconds; graphs built: "
        f"{counters['stats']['unique_graphs']}",
        ["cfg", "T", "B", "eager tok/s", "compiled tok/s", "compiled / eager",
         "first compiled step s", "load"],
        rows,
    )


if __name__ == "__main__":
    main()
