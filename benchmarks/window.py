"""The control of the state recipe: does the text reward context older than one block?

`recipe.py`'s GPT (the tiny preset's layers and heads, the width nearest its parameter count,
its optimizer) trained with a window of one block (128 bytes) and of two blocks (256), the
same number of steps (and, for the two-block window, once more at half the batch: the same
tokens), on the first 90% of `--data`; then every arm reads the held-out 10% in
non-overlapping windows of two blocks, and its loss on the second block's targets (positions
128-255) is read three ways, the same targets each time:

- `two blocks`: the whole window, 128 + j tokens of context at offset j of the second block;
- `one block`: the last 128 tokens before each target (a sliding window of one block);
- `block only`: the second block alone (j tokens of context), as a fresh BDH state reads it.

`block only - one block` is what the previous block's tokens add; `one block - two blocks`
is what context older than one block adds: if a GPT trained on two blocks gains nothing
there, this text does not reward memory older than a block at this model size. (For the
one-block arm, `two blocks` reads past its trained length.) Each difference comes with its
standard error over the windows (paired: the same targets).

    python benchmarks/window.py --steps 1400
    python benchmarks/window.py --steps 1000 --shapes 2x4   # one arm (a process per arm)
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import cpu_counters, fmt, machine_line, others_cpu_share, print_table
from recipe import DEFAULT_DATA, Recipe, bdh_arm, gpt_arm, load_bytes
from torch import nn

from bdh_train.train.allocator import configure_host_allocator

BUCKETS = ((0, 8), (8, 32), (32, 128))
"""Offsets inside the second block whose losses are also reported apart."""


@torch.no_grad()
def readings(model: nn.Module, windows: torch.Tensor, block: int) -> dict[str, np.ndarray]:
    """Per-target losses [W, block] of the second block of each window [W, 2 block + 1],
    read with `two blocks`, `one block` and `block only` of context."""
    model.eval()
    second = windows[:, block + 1 :]  # the targets of positions block .. 2 block - 1
    out: dict[str, list[torch.Tensor]] = {"two blocks": [], "one block": [], "block only": []}
    for lo in range(0, len(windows), 8):
        w, y = windows[lo : lo + 8], second[lo : lo + 8]
        logits, _ = model(w[:, :-1], w[:, 1:])
        out["two blocks"].append(nll(logits[:, block:], y))
        logits, _ = model(w[:, block:-1], w[:, block + 1 :])
        out["block only"].append(nll(logits, y))
        # the one-block window ending at position block + j starts at j + 1
        slides = w[:, 1 : 2 * block].unfold(1, block, 1)  # [b, block (j), block]
        last = []
        for row in slides:
            logits, _ = model(row, row)
            last.append(logits[:, -1])
        out["one block"].append(nll(torch.stack(last), y))
    model.train()
    return {k: torch.cat(v).numpy() for k, v in out.items()}


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    flat = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return flat.view(targets.shape)


def difference(a: np.ndarray, b: np.ndarray, lo: int = 0, hi: int | None = None) -> str:
    """Mean of a - b over offsets lo..hi and its standard error over the windows."""
    per_window = (a[:, lo:hi] - b[:, lo:hi]).mean(axis=1)
    se = per_window.std(ddof=1) / math.sqrt(len(per_window))
    return f"{per_window.mean():+.4f} ± {se:.4f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a text file (bytes)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--windows", type=int, default=0, help="held-out windows (0: all)")
    parser.add_argument(
        "--shapes",
        default="1x8,2x8,2x4",
        help="the arms: BLOCKSxBATCH, a window of BLOCKS blocks at that batch, comma-separated",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="the GPT's layers, each as wide as equal parameters allow (0: the preset's n_layer)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_host_allocator("auto", torch.device("cpu"))
    train, held = load_bytes(args.data)
    target = bdh_arm(Recipe(args.preset), "adamw", [], 1.0, args.preset).params
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    arms = []
    for blocks, batch in shapes:
        recipe = Recipe(
            args.preset,
            (f"training.block_size={blocks * args.block}", f"training.batch_size={batch}"),
        )
        label = f"window {blocks * args.block}, batch {batch}"
        arm = gpt_arm(recipe, "adamw", target, 1.0, args.layers)
        arm.recipe, arm.total_steps = label, args.steps
        arms.append(arm)
    print(f"machine: {machine_line()}")
    print(
        f"data: {args.data} ({len(train):,} train bytes, {len(held):,} held-out); {args.steps} "
        f"steps each; threads {args.threads}; the GPT of {args.preset}: {arms[0].params:,} "
        "parameters"
    )
    load = os.getloadavg()[0]
    before = cpu_counters()
    for arm in arms:
        arm.prime(train)
        while not arm.done:
            arm.step(train)
            if arm.steps % 200 == 0:
                print(
                    f"  {arm.recipe}: step {arm.steps}, train loss "
                    f"{np.mean(arm.losses[-50:]):.3f}, {arm.elapsed:.0f} s",
                    flush=True,
                )
    others = others_cpu_share(before, cpu_counters())
    span = 2 * args.block + 1
    count = (len(held) - 1) // span
    count = min(count, args.windows) if args.windows else count
    windows = held[: count * span].view(count, span)
    rows = []
    for arm in arms:
        r = readings(arm.model, windows, args.block)
        means = [fmt(float(r[k].mean()), ".4f") for k in ("two blocks", "one block", "block only")]
        older = [difference(r["one block"], r["two blocks"], lo, hi) for lo, hi in BUCKETS]
        rows.append(
            [arm.recipe, arm.steps, f"{arm.steps * arm.batch * arm.block:,}", fmt(arm.elapsed)]
            + means
            + [difference(r["block only"], r["one block"])]
            + [difference(r["one block"], r["two blocks"])]
            + older
        )
    headers = ["GPT", "steps", "tokens", "seconds", "two blocks", "one block", "block only"]
    headers += ["block only - one block", "one block - two blocks"]
    headers += [f"(older) offsets {lo}-{hi - 1}" for lo, hi in BUCKETS]
    print_table(
        f"held-out: {count} windows of {2 * args.block} bytes, loss (nats/byte) on the second "
        f"block; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"others used {others:.0%} of the CPUs",
        headers,
        rows,
    )


if __name__ == "__main__":
    main()
