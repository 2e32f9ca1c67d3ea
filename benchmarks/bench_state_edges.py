"""Train-step speed with the state read and written at its edges, against the whole call.

Under a fixed decay (position 'alibi'), a streamed step's incoming state reaches only the
first tokens of the block and its final state holds only the last ones: `decay_powers` gives
every other read and write a weight of exactly 0 past the decay horizon (`decay_horizon`: 75
tokens for alibi's slowest head, 4 heads, float32). `linear_attention` then runs the executor
over the block's own tokens and reads and writes the state with the first and last 75 tokens
only (`mixer._with_state_edges`); the whole call (the baseline) reads the state with every
token and writes it from every token, each weighed by its power, most of them 0.

Models: the tiny preset's (L2 D128 H4 N256, alibi, the demo) at its block of 128 and at 512,
and the small preset's widths (L6 D256 H4 N2048, alibi) at its block of 512, batch 1. A step
is `LanguageTrainModel.train_step` with the state streamed (carried from the previous step,
rows restarting a document at random): forward and backward, no optimizer step (which the
edges do not touch). Both variants train the same batches from the same weights; the last
column is the largest difference of their losses over every timed step.

The variants run in turn, `--rounds` times, so machine load hits both alike; tokens/s comes
from the fastest timed step, and each turn records the share of the CPUs other processes
used (others %).

Run: .venv/bin/python benchmarks/bench_state_edges.py [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _common import cpu_counters, machine_line, others_cpu_share, print_table

from bdh_train.batch import SequenceBatch
from bdh_train.model import BDH, BDHConfig, mixer
from bdh_train.model.positions import alibi_log_decay, decay_horizon
from bdh_train.train.step import LanguageTrainModel

TINY = dict(n_layer=2, n_embd=128, n_head=4, mlp_internal_dim_multiplier=8)
SMALL = dict(n_layer=6, n_embd=256, n_head=4, mlp_internal_dim_multiplier=32)
CASES = {  # name: (model widths, block, batch)
    "tiny, block 128 (the demo)": (TINY, 128, 8),
    "tiny, block 512": (TINY, 512, 2),
    "small, block 512": (SMALL, 512, 1),
}
WHOLE = "whole call"
EDGES = "edges"


def build(widths: dict) -> LanguageTrainModel:
    torch.manual_seed(0)
    config = BDHConfig(**widths, vocab_size=256, dropout=0.0, position="alibi")
    return LanguageTrainModel(BDH(config), streaming=True)


def batches(block: int, batch: int, n: int) -> list[SequenceBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 256, (batch, block + 1), generator=g)
        starts = torch.rand(batch, generator=g) < 0.125  # a document of 8 blocks, on average
        out.append(SequenceBatch(tokens[:, :-1], tokens[:, 1:], reset=starts))
    return out


def timed(step: LanguageTrainModel, work: list[SequenceBatch], edges: bool) -> list[tuple]:
    """(seconds, loss) of each batch's train step, with or without the edges."""
    whole: Callable[..., int | None] = lambda *args: None  # noqa: E731
    horizon = mixer.state_horizon
    mixer.state_horizon = horizon if edges else whole  # type: ignore[assignment]
    try:
        results = []
        for batch in work:
            started = time.perf_counter()
            loss = step.train_step(batch).loss
            results.append((time.perf_counter() - started, float(loss)))
        return results
    finally:
        mixer.state_horizon = horizon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}")
    print(f"decay horizon: {decay_horizon(alibi_log_decay(4), torch.float32)} tokens (float32)")
    rows = []
    for name, (widths, block, batch) in CASES.items():
        steps = {WHOLE: build(widths), EDGES: build(widths)}
        work = batches(block, batch, 1 + args.rounds * args.steps)
        best = {v: float("inf") for v in steps}
        others: dict[str, list[float]] = {v: [] for v in steps}
        losses: dict[str, list[float]] = {v: [] for v in steps}
        for variant, step in steps.items():  # warm-up, and the streamed state's first block
            losses[variant] += [loss for _, loss in timed(step, work[:1], variant == EDGES)]
        for r in range(args.rounds):
            chunk = work[1 + r * args.steps : 1 + (r + 1) * args.steps]
            for variant, step in steps.items():
                before = cpu_counters()
                done = timed(step, chunk, variant == EDGES)
                others[variant].append(others_cpu_share(before, cpu_counters()))
                best[variant] = min(best[variant], *(s for s, _ in done))
                losses[variant] += [loss for _, loss in done]
        tokens = block * batch
        gap = max(abs(a - b) for a, b in zip(losses[WHOLE], losses[EDGES], strict=True))
        rows.append(
            (
                name,
                batch,
                f"{tokens / best[WHOLE]:.0f}",
                f"{tokens / best[EDGES]:.0f}",
                f"{best[WHOLE] / best[EDGES]:.3f}x",
                " / ".join(f"{100 * x:.0f}" for x in others[WHOLE] + others[EDGES]),
                f"{gap:.1e}",
            )
        )
    print_table(
        "streamed train steps (forward + backward), fastest step",
        [
            "model, block",
            "batch",
            "whole call tok/s",
            "edges tok/s",
            "edges / whole",
            "others %",
            "max loss gap",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
