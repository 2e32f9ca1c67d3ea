"""Train-step speed with the state read and written at its edges, against the whole call.

Under a fixed decay (position 'alibi' or 'alibi_slow'), a streamed step's incoming state
reaches only the first tokens of the block in a head and its final state holds only the last
ones: `decay_powers` gives every other read and write a weight of exactly 0 past that head's
decay horizon (`decay_horizons`: 45, 53, 63 and 75 tokens for alibi's four heads in float32;
alibi_slow's last head 700). `linear_attention` then runs the executor over the block's own
tokens and reads and writes each head's state with its first and last W_h tokens only, W_h
capped at the block (`mixer._with_state_edges`); the whole call (the baseline) reads the
state with every token and writes it from every token, each weighed by its power, most of
them 0.

Models: the tiny preset's (L2 D128 H4 N256, alibi_slow, the demo) at its block of 128, the
same with alibi, and at 512 (chunked: the edges are not taken), and the small preset's
widths (L6 D256 H4 N2048, alibi) at its block of 512, batch 1. A step is
`LanguageTrainModel.train_step` with the state streamed (carried from the previous step,
rows restarting a document at random): forward and backward, no optimizer step (which the
edges do not touch). Both variants train the same batches from the same weights; the last
column is the largest difference of their losses over every timed step.

The variants take turns step by step on the same batch, so machine load hits both alike;
tokens/s comes from each variant's median step, the ratio is the median over the steps of
whole-call time / edges time for the same batch (the quartiles beside it show the spread),
and others % is the share of the CPUs other processes used during the case.

Run: .venv/bin/python benchmarks/bench_state_edges.py [--steps 30] [--only tiny]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _common import cpu_counters, machine_line, others_cpu_share, print_table

from bdh_train.batch import SequenceBatch
from bdh_train.model import BDH, BDHConfig, mixer
from bdh_train.model.positions import decay_horizons, position_log_decay
from bdh_train.train.step import LanguageTrainModel

TINY = dict(n_layer=2, n_embd=128, n_head=4, mlp_internal_dim_multiplier=8)
SMALL = dict(n_layer=6, n_embd=256, n_head=4, mlp_internal_dim_multiplier=32)
CASES = {  # name: (model widths, position, block, batch)
    "tiny, alibi_slow, block 128 (the demo)": (TINY, "alibi_slow", 128, 8),
    "tiny, alibi, block 128": (TINY, "alibi", 128, 8),
    "tiny, alibi_slow, block 512 (chunked: no edges)": (TINY, "alibi_slow", 512, 2),
    "small's widths, alibi, block 512": (SMALL, "alibi", 512, 1),
}
WHOLE = "whole call"
EDGES = "edges"


def build(widths: dict, position: str) -> LanguageTrainModel:
    torch.manual_seed(0)
    config = BDHConfig(**widths, vocab_size=256, dropout=0.0, position=position)
    return LanguageTrainModel(BDH(config), streaming=True)


def batches(block: int, batch: int, n: int) -> list[SequenceBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 256, (batch, block + 1), generator=g)
        starts = torch.rand(batch, generator=g) < 0.125  # a document of 8 blocks, on average
        out.append(SequenceBatch(tokens[:, :-1], tokens[:, 1:], reset=starts))
    return out


def timed(step: LanguageTrainModel, batch: SequenceBatch, edges: bool) -> tuple[float, float]:
    """(seconds, loss) of one batch's train step, with or without the edges."""
    whole: Callable[..., tuple[int, ...] | None] = lambda *args: None  # noqa: E731
    horizons = mixer.state_horizons
    mixer.state_horizons = horizons if edges else whole  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        loss = step.train_step(batch).loss
        return time.perf_counter() - started, float(loss)
    finally:
        mixer.state_horizons = horizons


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}")
    for position in ("alibi", "alibi_slow"):
        log_decay = position_log_decay(position, 4)
        assert log_decay is not None
        horizons = decay_horizons(log_decay, torch.float32)
        print(f"{position}'s decay horizons (float32, 4 heads): {horizons} tokens")
    rows = []
    for name, (widths, position, block, batch) in CASES.items():
        if args.only not in name:
            continue
        steps = {WHOLE: build(widths, position), EDGES: build(widths, position)}
        work = batches(block, batch, 2 + args.steps)
        seconds: dict[str, list[float]] = {v: [] for v in steps}
        losses: dict[str, list[float]] = {v: [] for v in steps}
        before = cpu_counters()
        for i, batch_i in enumerate(work):  # the first two: warm-up, and the state's first block
            for variant, step in steps.items():
                took, loss = timed(step, batch_i, variant == EDGES)
                losses[variant].append(loss)
                if i >= 2:
                    seconds[variant].append(took)
        others = others_cpu_share(before, cpu_counters())
        tokens = block * batch
        ratios = [a / b for a, b in zip(seconds[WHOLE], seconds[EDGES], strict=True)]
        q1, ratio, q3 = quartiles(ratios)
        gap = max(abs(a - b) for a, b in zip(losses[WHOLE], losses[EDGES], strict=True))
        rows.append(
            (
                name,
                batch,
                f"{tokens / statistics.median(seconds[WHOLE]):.0f}",
                f"{tokens / statistics.median(seconds[EDGES]):.0f}",
                f"{ratio:.3f}x ({q1:.3f}-{q3:.3f})",
                f"{100 * others:.0f}",
                f"{gap:.1e}",
            )
        )
    print_table(
        "streamed train steps (forward + backward), median step; the ratio is the median of "
        "each step's pair (quartiles in brackets)",
        [
            "model, block",
            "batch",
            "whole call tok/s",
            "edges tok/s",
            "whole / edges per step",
            "others %",
            "max loss gap",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
