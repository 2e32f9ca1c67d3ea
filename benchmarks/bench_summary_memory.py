"""Train-step speed with summary memory on and off.

Config (a) (L4 D128 H4 multiplier 16, N=512, vocab 256, dropout 0), T=512, batch 8, fp32,
2 threads, the config's executor ("auto"). A step is `LanguageTrainModel.train_step`
(forward + backward of the mean loss; no optimizer step, which summary memory does not touch).

Variants:
* off: the default model (summary memory disabled);
* on: every layer, the default summary settings (chunk_tokens 32, no gates);
* on + gates: every layer, surprise gate (threshold 0.1) and write gate, with an event mask
  marking about 5% of the tokens (a seeded random mask: the cost does not depend on where
  the events are).

A second table times the summary branch alone (`summary.summary_branch`, forward + backward,
once per layer on a [8, 1, 512, 128] input, i.e. the work summary memory adds to a step),
fastest of the same rounds; its share of the "off" step is the branch's cost with the noise
of two whole-step timings taken out.

The variants run in turn, `--rounds` times (off, on, on + gates, off, on, ...), so a change of
machine load hits all of them alike; each turn times `--steps` steps after one warm-up step
per variant at the start. tokens/s comes from the fastest timed step over all rounds
(contention only ever slows a step). Every turn also records the share of the CPUs other
processes used meanwhile (others %) and the 1-minute load average.

Run: .venv/bin/python benchmarks/bench_summary_memory.py [--rounds 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import (
    CONFIGS,
    cpu_counters,
    load_average,
    machine_line,
    others_cpu_share,
    print_table,
    wait_for_quiet,
)

from bdh_train.batch import SequenceBatch
from bdh_train.model import BDH, BDHConfig
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.summary import summary_branch
from bdh_train.train.step import LanguageTrainModel

CONFIG_A = CONFIGS["a"]
BLOCK, BATCH, EVENT_RATE = 512, 8, 0.05
VARIANTS = {
    "off": (SummaryMemoryConfig(), False),
    "on": (SummaryMemoryConfig(enabled=True), False),
    "on + gates": (
        SummaryMemoryConfig(enabled=True, surprise_gate_threshold=0.1, write_gate=True),
        True,
    ),
}


def build(summary: SummaryMemoryConfig) -> LanguageTrainModel:
    torch.manual_seed(0)
    model = BDH(BDHConfig(**CONFIG_A, vocab_size=256, dropout=0.0, summary_memory=summary))
    return LanguageTrainModel(model)


def make_batch(with_mask: bool) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 256, (BATCH, BLOCK), generator=g)
    targets = torch.randint(0, 256, (BATCH, BLOCK), generator=g)
    mask = (torch.rand(BATCH, BLOCK, generator=g) < EVENT_RATE) if with_mask else None
    return SequenceBatch(inputs, targets, summary_event_mask=mask)


def timed_steps(step: LanguageTrainModel, batch: SequenceBatch, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        step.train_step(batch)
        times.append(time.perf_counter() - started)
    return times


def branch_seconds(cfg: SummaryMemoryConfig, mask: torch.Tensor | None) -> float:
    """Forward + backward of the summary branch for every layer of one step."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(BATCH, 1, BLOCK, CONFIG_A["n_embd"], generator=g, requires_grad=True)
    position = torch.zeros(BATCH, dtype=torch.long)
    started = time.perf_counter()
    for _ in range(CONFIG_A["n_layer"]):
        branch, _ = summary_branch(u, None, position, cfg, mask)
        branch.sum().backward()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each round wait up to S seconds for other processes to leave the CPUs",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_line()}")
    runs = {name: (build(cfg), make_batch(masked)) for name, (cfg, masked) in VARIANTS.items()}
    for step, batch in runs.values():
        step.train_step(batch)  # warm-up
    best = {name: float("inf") for name in runs}
    branch_best = {name: float("inf") for name in runs if name != "off"}
    others: dict[str, list[float]] = {name: [] for name in runs}
    loads: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        if args.wait_quiet > 0:
            wait_for_quiet(args.wait_quiet)
        for name, (step, batch) in runs.items():
            loads[name].append(load_average())
            before = cpu_counters()
            best[name] = min(best[name], *timed_steps(step, batch, args.steps))
            others[name].append(others_cpu_share(before, cpu_counters()))
        for name in branch_best:
            cfg, _ = VARIANTS[name]
            mask = runs[name][1].summary_event_mask
            for _ in range(args.steps):
                branch_best[name] = min(branch_best[name], branch_seconds(cfg, mask))
    tokens = BLOCK * BATCH
    rows = [
        (
            name,
            f"{tokens / best[name]:.0f}",
            f"{best[name]:.2f}",
            f"{best['off'] / best[name]:.3f}",
            " / ".join(f"{100 * x:.0f}" for x in others[name]),
            " / ".join(f"{x:.2f}" for x in loads[name]),
        )
        for name in runs
    ]
    print_table(
        f"summary memory, config (a), T={BLOCK}, batch {BATCH}, fp32, {args.threads} threads; "
        f"train step (forward + backward); fastest of {args.rounds} rounds x {args.steps} "
        "steps, variants alternating; speed vs off: tokens/s ratio; others %: CPU capacity "
        "other processes used in each round; load: 1-min load average at each round's start",
        ("variant", "tokens/s", "s/step", "speed vs off", "others % per round", "load"),
        rows,
    )
    print_table(
        f"the summary branch alone: forward + backward for {CONFIG_A['n_layer']} layers on "
        f"[{BATCH}, 1, {BLOCK}, {CONFIG_A['n_embd']}], fastest of the same rounds; share of "
        "step: against the fastest 'off' step",
        ("variant", "ms per step", "share of step"),
        [
            (name, f"{1e3 * sec:.1f}", f"{100 * sec / best['off']:.1f}%")
            for name, sec in branch_best.items()
        ],
    )


if __name__ == "__main__":
    main()
