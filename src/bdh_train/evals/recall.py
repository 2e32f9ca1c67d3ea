"""Multi-query associative recall (MQAR, `bdh_train.data.mqar`): what a model can look up.

For each number of pairs P and each example length L, `examples` fresh MQAR examples are
read whole, from a fresh state (a BDH reads any length with its state carried from chunk to
chunk; a length past the trained one measures whether the state still holds the pairs). At
each query key the model's most likely next token is compared with the key's value: the
accuracy of a cell is the share of its examples x P queries answered. A guess uniform over
the value ids scores 1 / (V - V/2) (`chance_accuracy`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bdh_train.batch import IGNORE_INDEX
from bdh_train.data.mqar import chance_accuracy, check_shape, mqar_examples
from bdh_train.errors import ConfigError
from bdh_train.evals.context import plot_grid
from bdh_train.evals.scoring import score_batch
from bdh_train.model.bdh import BDH
from bdh_train.model.summary import SummaryEvents

Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(inputs [n, L] ids, targets [n, L] ids) -> bool [n, L]: whether the model's most likely
next token after inputs[:, : t + 1] is targets[:, t]."""


@dataclass
class RecallGrid:
    """Accuracy per number of pairs x example length."""

    pairs: list[int]
    lengths: list[int]
    examples: int
    vocab_size: int
    trained_length: int | None
    """The length the model trained on, marked in the table (None: not known)."""
    accuracy: list[list[float]]
    """accuracy[i][j]: pairs[i] pairs, lengths[j] tokens; the share of queries answered."""
    chance: float
    """The accuracy of a uniform guess among the value ids."""

    def table(self) -> str:
        labels = [f"{n:,}" + ("*" if n == self.trained_length else "") for n in self.lengths]
        head = f"{'pairs':>7}" + "".join(f"{label:>10}" for label in labels)
        trained = "" if self.trained_length is None else ", * the trained length"
        lines = [
            f"recall (MQAR): accuracy over {self.examples} examples per cell, vocabulary "
            f"{self.vocab_size} (chance {self.chance:.4f}); columns: tokens per example"
            f"{trained}",
            head,
        ]
        for pairs, row in zip(self.pairs, self.accuracy, strict=True):
            lines.append(f"{pairs:>7}" + "".join(f"{a:>10.3f}" for a in row))
        return "\n".join(lines)

    def run_end_line(self) -> str:
        """One line on the first row (a number of pairs): its accuracy at the first length
        (marked when it is the trained one) and, with the state carried, at each longer
        one."""
        first, *longer = zip(self.lengths, self.accuracy[0], strict=True)
        beyond = ", ".join(f"{a:.3f} at {n:,} tokens" for n, a in longer)
        carried = f"; with the state carried {beyond}" if beyond else ""
        trained = " (the trained length)" if first[0] == self.trained_length else ""
        return (
            f"recall         {first[1]:.3f} of {self.pairs[0]} pairs answered in "
            f"{first[0]:,}-token examples{trained}{carried} (chance "
            f"{self.chance:.3f}, {self.examples} examples each)"
        )


def check_cells(pairs: Sequence[int], lengths: Sequence[int], vocab_size: int) -> None:
    """ConfigError, before anything is built, for a cell whose pairs do not fit its length or
    the vocabulary."""
    if not pairs or not lengths or min(pairs) < 1 or min(lengths) < 1:
        raise ConfigError(
            f"--recall-pairs and --recall-lengths must be positive (got {list(pairs)} and "
            f"{list(lengths)})"
        )
    check_shape(max(pairs), min(lengths), vocab_size, "--recall-pairs", "--recall")


def recall_accuracy(scorer: Scorer, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of the answers (targets not IGNORE_INDEX) that `scorer` gets right."""
    answers = targets != IGNORE_INDEX
    right = scorer(tokens, targets.masked_fill(~answers, 0))
    return float(right[answers].double().mean())


def recall_grid(
    scorer: Scorer,
    pairs: Sequence[int],
    lengths: Sequence[int],
    vocab_size: int,
    examples: int,
    seed: int,
    power_a: float = 0.01,
    trained_length: int | None = None,
    random_fill: bool = True,
) -> RecallGrid:
    """The accuracy of `scorer` on `examples` examples (`mqar_examples` seeded by `seed`, the
    cell's pairs and length, with the generator's `power_a` and `random_fill`) per pairs x
    length."""
    check_cells(pairs, lengths, vocab_size)
    if examples < 1:
        raise ConfigError(f"--recall-examples must be at least 1, got {examples}")
    accuracy = []
    for p in pairs:
        row = []
        for length in lengths:
            tokens, targets = mqar_examples(
                p, length, vocab_size, examples, [seed, p, length], power_a, random_fill
            )
            row.append(recall_accuracy(scorer, torch.from_numpy(tokens), torch.from_numpy(targets)))
        accuracy.append(row)
    return RecallGrid(
        list(pairs),
        list(lengths),
        examples,
        vocab_size,
        trained_length,
        accuracy,
        chance_accuracy(vocab_size),
    )


def model_scorer(
    model: BDH, batch_size: int, summary_events: SummaryEvents | None = None
) -> Scorer:
    """A BDH's scorer: `batch_size` rows at a time, each read from a fresh state with the
    state carried through its whole length (`score_batch`)."""

    def scorer(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = range(0, len(inputs), batch_size)
        return torch.cat(
            [
                score_batch(
                    model, inputs[i : i + batch_size], targets[i : i + batch_size], summary_events
                )[1]
                for i in rows
            ]
        )

    return scorer


def plot_recall(grid: RecallGrid, path: str | os.PathLike[str]) -> Path:
    """The accuracy heat map (pairs x length), each cell labelled, written atomically."""
    return plot_grid(
        grid.accuracy,
        [f"{n:,}" for n in grid.lengths],
        [str(p) for p in grid.pairs],
        "tokens per example",
        "key-value pairs",
        f"recall accuracy ({grid.examples} examples per cell)",
        path,
    )
