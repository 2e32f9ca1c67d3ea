"""Heads-major projections against the contiguous layout, in whole train steps.

For long inputs (`matmul.heads_major`) each per-head projection runs as H GEMMs over all
B*T rows and leaves its result heads-major ([H, B, T, N] in memory, a [B, H, T, N] view)
through relu, rope, the mixer, the norm and the gate. The contiguous twin is the same model
with `matmul.heads_major` forced False: one folded GEMM [B*T, D] x [D, H*N] per projection
and a copy into a contiguous [B, H, T, N]. tests/model/test_model_executors.py holds the two
to the same loss and gradients (float64, 1e-12).

Same weights and batch; train steps (forward, backward, AdamW, executor auto) alternate
between the layouts, 1 warm-up each, and the table gives the fastest of --rounds (tokens/s)
and their ratio. fp32, vocab 256, 2 threads, host allocator 'retain' on the CPU.

Run: .venv/bin/python benchmarks/bench_layout.py [--grid a:512x8,a:2048x2,a:2048x8,b:512x4]
     [--rounds 3] [--position rope] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch
from _common import CONFIGS, load_average, machine_line, print_table, timed_train_step

from bdh_train.model import BDH, BDHConfig, matmul
from bdh_train.train.allocator import configure_host_allocator

DEFAULT_GRID = "a:512x8,a:2048x2,a:2048x8,b:512x4"


def fastest_steps(
    config: str, seq_len: int, batch: int, rounds: int, position: str, device: torch.device
) -> dict[str, float]:
    """Seconds of the fastest train step of each layout, the layouts alternating."""
    torch.manual_seed(0)
    cfg = BDHConfig(**CONFIGS[config], vocab_size=256, dropout=0.0, position=position)
    model = BDH(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (batch, seq_len + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    heads_major = matmul.heads_major
    layouts = {"heads-major": heads_major, "contiguous": lambda inputs, weight: False}
    best = dict.fromkeys(layouts, float("inf"))
    try:
        for round_index in range(rounds + 1):
            for name, rule in layouts.items():
                matmul.heads_major = rule
                seconds = timed_train_step(model, optimizer, inputs, targets)
                if round_index:  # the first round warms up
                    best[name] = min(best[name], seconds)
    finally:
        matmul.heads_major = heads_major
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default=DEFAULT_GRID, help="config:TxB points, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--position", default="rope", choices=["rope", "alibi"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(2)
    configure_host_allocator("retain", device)
    print(machine_line())
    rows = []
    for point in args.grid.split(","):
        config, shape = point.split(":")
        seq_len, batch = (int(x) for x in shape.split("x"))
        best = fastest_steps(config, seq_len, batch, args.rounds, args.position, device)
        tokens = seq_len * batch
        major, contiguous = tokens / best["heads-major"], tokens / best["contiguous"]
        rows.append(
            (
                config,
                seq_len,
                batch,
                f"{contiguous:.0f}",
                f"{major:.0f}",
                f"{major / contiguous:.3f}x",
                f"{load_average():.1f}",
            )
        )
        print(f"  {point}: contiguous {contiguous:.0f} tok/s, heads-major {major:.0f}", flush=True)
    print_table(
        f"train step tokens/s, {args.position}, fastest of {args.rounds} alternating steps "
        f"(after 1 warm-up each); ratio = heads-major / contiguous",
        ["cfg", "T", "B", "contiguous tok/s", "heads-major tok/s", "ratio", "load"],
        rows,
    )


if __name__ == "__main__":
    main()
