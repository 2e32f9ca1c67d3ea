"""Validation: the mean loss over counted targets of a fixed set of batches, and bits per byte
where the tokens are the bytes of text. One function serves the trainer and `bdh-train eval`.
Data-parallel ranks each take every world-th batch and add their sums together."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bdh_train.batch import SequenceBatch
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.loaders import eval_batches
from bdh_train.data.sources import TokenData
from bdh_train.errors import DataError


class EvalLoss(Protocol):
    def eval_loss(self, batch: SequenceBatch) -> tuple[float, float]:
        """(loss sum over counted targets, counted targets) of `batch`, without a graph."""
        ...


@dataclass
class EvalResult:
    val_loss: float
    """Mean loss (nats) per counted target."""
    tokens: int
    """Counted targets the mean is over."""
    bits_per_byte: float | None
    """The loss in bits per byte of text; None when the tokens are not bytes."""

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"val_loss": self.val_loss}
        if self.bits_per_byte is not None:
            out["bits_per_byte"] = self.bits_per_byte
        return out


def evaluate(
    step: EvalLoss,
    data: TokenData,
    block_size: int,
    batch_size: int,
    max_batches: int | None,
    device: torch.device | str = "cpu",
    summary_trigger: SummaryEventTrigger | None = None,
    part: tuple[int, int] = (0, 1),
    add_across_ranks: Callable[[list[float]], list[float]] | None = None,
) -> EvalResult:
    """Every token after the first of the first `max_batches` eval batches, predicted once
    (with their summary event masks when there is a trigger).

    With `part = (rank, world)` this process evaluates batches rank, rank + world, ... and
    `add_across_ranks` (an all-reduce SUM over the data-parallel ranks) turns its sums into
    the sums over all batches, so every rank returns the one-process result."""
    rank, world = part
    total, count = 0.0, 0.0
    batches = eval_batches(data, block_size, batch_size, max_batches, summary_trigger)
    for batch in itertools.islice(batches, rank, None, world):
        loss_sum, counted = step.eval_loss(batch.to(device))
        total += loss_sum
        count += counted
    if add_across_ranks is not None:
        total, count = add_across_ranks([total, count])
    if count == 0:  # a mean over nothing is no number, least of all 0.0
        raise DataError(
            f"evaluation counted no tokens ({max_batches} batches of {data.source}); "
            "give at least one batch of data longer than one token"
        )
    val_loss = total / count
    bits = val_loss / math.log(2) if data.byte_level else None
    return EvalResult(val_loss, int(count), bits)
