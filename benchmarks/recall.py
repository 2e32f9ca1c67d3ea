"""Multi-query associative recall (MQAR, `bdh_train.data.mqar`): a tiny BDH against a GPT of
equal parameter count, trained for equal wall-clock on the same examples, then scored at the
trained length and past it.

Both arms train on the same batches: batch k is `--batch` fresh MQAR examples of `--length`
tokens with `--pairs` pairs (seeded by k), the loss on the answers only (Zoology's loss: the
targets are IGNORE_INDEX except at each query key). The arms alternate one optimizer step
each, each on its own clock (`recipe.py`'s `Arm`: warm-up, then cosine over the budget's
seconds), until both have spent `--budget` seconds. Every `--every` seconds of an arm's
clock, and at the end, the arm is scored (off the clock) on `--eval-examples` held-out
examples (another seed) at the trained length: accuracy against training time. At the end
both are scored at 1, 2 and 4 times the trained length, the same pairs:

- BDH reads each example whole, from a fresh state, with its state carried (`bdh-train
  eval --recall`'s scorer);
- the GPT reads each answer's last `--length` tokens (its window: past the trained length
  the pairs fall out of it), and also the whole example at once (`GPT full`: attention past
  the length it was trained on).

The BDH is the `--preset` with `--set` overrides and `model.vocab_size = --vocab`; the GPT
is `recipe.py`'s baseline with the preset's layers and heads, its width the one nearest
BDH's parameter count.

    python benchmarks/recall.py --budget 600 --pairs 16 --length 128
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from _common import cpu_counters, fmt, machine_line, others_cpu_share, print_table
from recipe import GPT, Arm, Recipe, bdh_arm, gpt_arm

from bdh_train.config import load_config
from bdh_train.data.mqar import chance_accuracy, mqar_examples
from bdh_train.evals.recall import model_scorer, recall_accuracy
from bdh_train.model.bdh import BDH
from bdh_train.train.allocator import configure_host_allocator
from bdh_train.train.optim import OPTIMIZERS

EVAL_SEED = 1 << 20
"""Held-out examples are drawn with this seed (training batch k uses seed [seed, k])."""


@dataclass
class Task:
    """The MQAR examples both arms train on."""

    pairs: int
    length: int
    vocab: int
    batch: int
    seed: int
    curriculum: tuple[tuple[int, int], ...] = ()
    """(pairs, until step): batches before `until` hold these pairs (the first that applies);
    from the last `until` on, `pairs`."""

    def pairs_at(self, k: int) -> int:
        return next((p for p, until in self.curriculum if k < until), self.pairs)

    def batch_at(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = mqar_examples(
            self.pairs_at(k), self.length, self.vocab, self.batch, [self.seed, k]
        )
        return torch.from_numpy(tokens), torch.from_numpy(targets)


@dataclass
class RecallArm(Arm):
    """An `Arm` whose steps are MQAR batches (`Task.batch_at(step)`), with its accuracy
    recorded against its clock."""

    curve: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds, steps, accuracy at the trained length) at each scoring."""
    cpu: float = 0.0
    """CPU seconds of this arm's steps (all threads of the process)."""

    @classmethod
    def of(cls, arm: Arm) -> RecallArm:
        return cls(**{f.name: getattr(arm, f.name) for f in fields(Arm) if f.init})

    def prime(self, task: Task) -> None:  # type: ignore[override]
        tokens, targets = task.batch_at(1 << 30)
        self.forward_backward(tokens[:2], targets[:2])
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, task: Task) -> None:  # type: ignore[override]
        started, cpu = time.perf_counter(), time.process_time()
        tokens, targets = task.batch_at(self.steps)
        self.set_lr()
        loss = self.forward_backward(tokens, targets)
        self.finish_step(started, loss)
        self.cpu += time.process_time() - cpu


@torch.no_grad()
def gpt_scorer(model: GPT, window: int | None):
    """The GPT's scorer: each answer predicted from its last `window` tokens (None: the
    whole example). The answers are the nonzero targets (values are ids >= V/2)."""

    def scorer(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model.eval()
        right = torch.zeros_like(targets, dtype=torch.bool)
        if window is None or inputs.shape[1] <= window:
            logits, _ = model(inputs, targets)
            right = logits.argmax(-1) == targets
        else:
            rows, cols = torch.nonzero(targets, as_tuple=True)
            for lo in range(0, len(rows), 256):
                r, c = rows[lo : lo + 256], cols[lo : lo + 256]
                first = (c - window + 1).clamp(min=0)
                # windows ending at each answer's key, left-aligned (a shorter one is padded
                # on the right, after the key: its prediction is read at the key)
                span = torch.arange(window)
                at = (first[:, None] + span).clamp(max=inputs.shape[1] - 1)
                logits, _ = model(inputs[r[:, None], at], targets[r[:, None], at])
                last = c - first
                picked = logits[torch.arange(len(r)), last].argmax(-1)
                right[r, c] = picked == targets[r, c]
        model.train()
        return right

    return scorer


def held_out(task: Task, length: int, examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = mqar_examples(task.pairs, length, task.vocab, examples, EVAL_SEED)
    return torch.from_numpy(tokens), torch.from_numpy(targets)


def accuracy(arm: Arm, task: Task, length: int, examples: int, window: bool = True) -> float:
    tokens, targets = held_out(task, length, examples)
    if isinstance(arm.model, BDH):
        arm.model.eval()
        scorer = model_scorer(arm.model, 16)
        value = recall_accuracy(scorer, tokens, targets)
        arm.model.train()
        return value
    return recall_accuracy(gpt_scorer(arm.model, task.length if window else None), tokens, targets)


def state_floats(arm: Arm, length: int) -> int:
    """What the arm carries from the past at `length` tokens: BDH's state (per layer H x N x
    D), the GPT's key-value cache (per layer 2 x tokens x width)."""
    if isinstance(arm.model, BDH):
        c = arm.model.config
        neurons = c.n_embd * c.mlp_internal_dim_multiplier // c.n_head
        return c.n_layer * c.n_head * neurons * c.n_embd
    layers = len(arm.model.blocks)  # type: ignore[arg-type]
    return layers * 2 * length * arm.model.embed.embedding_dim  # type: ignore[union-attr]


def train(arms: list[RecallArm], task: Task, every: float, examples: int) -> float:
    """Alternate one step per unfinished arm until each has spent its budget, scoring each
    every `every` seconds of its clock (steps, for arms trained for a number of steps); the
    share of the CPUs other processes used."""
    for arm in arms:
        arm.prime(task)
    before = cpu_counters()
    while not all(a.done for a in arms):
        for arm in arms:
            if arm.done:
                continue
            arm.step(task)
            due = (len(arm.curve) + 1) * every
            clock = arm.steps if arm.total_steps else arm.elapsed
            if clock >= due or arm.done:
                acc = accuracy(arm, task, task.length, examples)
                arm.curve.append((arm.elapsed, arm.steps, acc))
                print(
                    f"  {arm.model_name}: {arm.elapsed:6.0f} s ({arm.cpu:.0f} CPU s), step "
                    f"{arm.steps:5d} ({task.pairs_at(arm.steps - 1)} pairs), train loss "
                    f"{np.mean(arm.losses[-20:]):.3f}, accuracy {acc:.3f}",
                    flush=True,
                )
    return others_cpu_share(before, cpu_counters())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, help="seconds of training per arm (600)")
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="train each arm this many steps instead (the schedule over steps; --every in steps)",
    )
    parser.add_argument(
        "--curriculum",
        default="",
        metavar="PAIRS:UNTIL,...",
        help="fewer pairs first: e.g. 4:200,8:400 (4 pairs before step 200, 8 before 400)",
    )
    parser.add_argument("--pairs", type=int, help="default 16, or the config's data.mqar.pairs")
    parser.add_argument(
        "--length", type=int, help="tokens per example (128, or the config's data.mqar.length)"
    )
    parser.add_argument("--vocab", type=int, help="default 256, or the config's model.vocab_size")
    parser.add_argument("--batch", type=int, help="default 32, or the config's batch_size")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--config",
        help="the BDH arm's config file (instead of --preset); the task's pairs, length, "
        "vocabulary, batch and, without --steps and --budget, steps come from it (not "
        "data.mqar.min_pairs: every example holds the pairs; --curriculum mixes in fewer)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="for the BDH arm"
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="both arms' optimizer (default: the BDH config's optimizer.name, e.g. the tiny "
        "preset's muon)",
    )
    parser.add_argument("--no-gpt", action="store_true", help="train the BDH arm only")
    parser.add_argument("--every", type=float, default=60, help="seconds between scorings")
    parser.add_argument("--eval-examples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_host_allocator("auto", torch.device("cpu"))
    curriculum = tuple(
        (int(p), int(u)) for p, u in (c.split(":") for c in args.curriculum.split(",") if c)
    )
    if args.config:
        cfg = load_config([args.config], args.set)
        mqar = cfg.data.mqar
        args.pairs = args.pairs or mqar.pairs
        args.length = args.length or mqar.length
        args.vocab = args.vocab or mqar.vocab_size or cfg.model.vocab_size
        args.batch = args.batch or cfg.training.batch_size
        if args.budget is None and not args.steps:
            args.steps = cfg.training.max_steps
        args.preset = args.config
    args.pairs, args.length = args.pairs or 16, args.length or 128
    args.vocab, args.batch = args.vocab or 256, args.batch or 32
    args.budget = args.budget or 600.0
    task = Task(args.pairs, args.length, args.vocab, args.batch, args.seed, curriculum)
    recipe = Recipe(
        args.preset,
        (*args.set, f"model.vocab_size={args.vocab}", f"training.batch_size={args.batch}"),
        (args.config,) if args.config else (),
    )
    optimizer = args.optimizer or recipe.config().optimizer.name
    bdh = bdh_arm(recipe, optimizer, [], args.budget, args.preset, streamed=False)
    arms = [RecallArm.of(bdh)]
    if not args.no_gpt:
        arms.append(RecallArm.of(gpt_arm(recipe, optimizer, arms[0].params, args.budget)))
    for arm in arms:
        arm.total_steps = args.steps
    print(f"machine: {machine_line()}")
    print(
        f"MQAR: {args.pairs} pairs, {args.length} tokens, vocabulary {args.vocab} (chance "
        f"{chance_accuracy(args.vocab):.4f}); batch {args.batch}; BDH {args.preset} "
        f"{' '.join(args.set)}; threads {args.threads}"
        + (f"; curriculum {args.curriculum}" if curriculum else "")
    )
    load = os.getloadavg()[0]
    others = train(arms, task, args.every, args.eval_examples)
    lengths = [args.length * m for m in (1, 2, 4)]
    rows = []
    for arm in arms:
        scored = [accuracy(arm, task, n, args.eval_examples) for n in lengths]
        rows.append(
            [arm.model_name, f"{arm.params:,}", arm.steps, fmt(arm.elapsed), fmt(arm.cpu)]
            + [fmt(a, ".3f") for a in scored]
            + [f"{state_floats(arm, n):,}" for n in (lengths[0], lengths[-1])]
        )
        if arm.model_name == "GPT":
            full = [accuracy(arm, task, n, args.eval_examples, window=False) for n in lengths]
            rows.append(["GPT full", "", "", "", ""] + [fmt(a, ".3f") for a in full] + ["", ""])
    headers = ["model", "params", "steps", "seconds", "CPU s"]
    headers += [f"acc @{n}" for n in lengths]
    headers += [f"state floats @{lengths[0]}", f"@{lengths[-1]}"]
    print_table(
        f"MQAR {args.pairs} pairs, "
        + (f"{args.steps} steps" if args.steps else f"{args.budget:.0f} s")
        + f" per arm: load average {load:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end; others used {others:.0%} of the CPUs",
        headers,
        rows,
    )
    print()
    for arm in arms:
        curve = ", ".join(f"{t:.0f} s (step {k}) {a:.3f}" for t, k, a in arm.curve)
        print(f"{arm.model_name} accuracy at {args.length} against its clock: {curve}")


if __name__ == "__main__":
    main()
