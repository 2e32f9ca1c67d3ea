"""Eager against compiled train steps of bdh-train (`training.compile`: 'layer' compiles the
whole shared layer, 'pointwise' the layer's fused gate), alternating in one process.

Models with the same weights (config a or b of _common.CONFIGS, vocab 256, fp32, dropout 0,
2 threads, executor auto, the host allocator as the trainer sets it) and an AdamW each: one
eager and one per mode of --modes. Each compiled model's first step builds its graphs (its
time is printed apart); then --rounds rounds of one step of every model in turn. tokens/s
from the fastest step; the dynamo counters after the run show how many graphs were built.

Run: .venv/bin/python benchmarks/bench_compile.py [--configs a --grid 512x8,2048x8
         --modes pointwise,layer]
"""

from __future__ import annotations

import argparse

import torch
from _common import CONFIGS, load_average, machine_line, print_table, timed_train_step
from torch._dynamo.utils import counters

from bdh_train.model import BDH, BDHConfig
from bdh_train.model.bdh import COMPILE_MODES
from bdh_train.train.allocator import configure_host_allocator


def measure(config: str, seq_len: int, batch: int, modes: list[str], rounds: int) -> list:
    sides = {}
    for mode in ("off", *modes):
        torch.manual_seed(0)
        model = BDH(BDHConfig(**CONFIGS[config], vocab_size=256, dropout=0.0))
        model.compile_for_training(mode)
        sides[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randint(0, 256, (batch, seq_len))
    y = torch.randint(0, 256, (batch, seq_len))

    def step(side: str) -> float:
        model, optimizer = sides[side]
        return timed_train_step(model, optimizer, x, y)

    load = load_average()
    step("off")
    first = {mode: step(mode) for mode in modes}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in times:
            times[side].append(step(side))
    rate = {side: seq_len * batch / min(times[side]) for side in sides}
    row = [config, seq_len, batch, f"{rate['off']:.0f}"]
    for mode in modes:
        row += [f"{rate[mode]:.0f}", f"{rate[mode] / rate['off']:.3f}x", f"{first[mode]:.0f}"]
    return [*row, f"{load:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="a")
    ap.add_argument("--grid", default="512x8,2048x8")
    ap.add_argument("--modes", default="pointwise,layer", help="comma list of compile modes")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    modes = args.modes.split(",")
    compiling = [m for m in COMPILE_MODES if m != "off"]
    for mode in modes:
        if mode not in compiling:
            ap.error(f"--modes: {mode!r} is not a compile mode ({', '.join(compiling)})")
    torch.set_num_threads(2)
    allocator = configure_host_allocator("auto", torch.device("cpu"))
    print(f"machine: {machine_line()}; host allocator: {allocator}")
    rows = []
    for config in args.configs.split(","):
        for point in args.grid.split(","):
            seq_len, batch = (int(v) for v in point.split("x"))
            rows.append(measure(config, seq_len, batch, modes, args.rounds))
            print(rows[-1], flush=True)
    headers = ["cfg", "T", "B", "eager tok/s"]
    for mode in modes:
        headers += [f"{mode} tok/s", f"{mode} / eager", f"{mode} first step s"]
    print_table(
        "train step tokens/s (fastest of the rounds), eager and each compile mode in turn; "
        f"first compiled step (graph build) in seconds; graphs built: "
        f"{counters['stats']['unique_graphs']}",
        [*headers, "load"],
        rows,
    )


if __name__ == "__main__":
    main()
