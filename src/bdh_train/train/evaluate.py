"""Validation: the mean loss over counted targets of a fixed set of batches, and bits per byte
where the tokens are text of a tokenizer. One function serves the trainer and `bdh-train eval`.
Data-parallel ranks each take every world-th batch and add their sums together.

Bits per byte (the one rule): the loss in nats summed over the counted targets, divided by
ln 2 and by the UTF-8 bytes those same targets decode to (`Tokenizer.token_byte_lengths`,
counted with the head's own mask, `heads.counted_target_mask`). For the byte tokenizer every
target is one byte, so it is the mean loss / ln 2; for a BPE it compares across vocabularies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from bdh_train.batch import SequenceBatch
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.loaders import eval_batches
from bdh_train.data.tokens import TokenData
from bdh_train.errors import DataError
from bdh_train.model.config import LanguageHeadConfig
from bdh_train.model.heads import counted_target_mask


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
    """The loss in bits per UTF-8 byte of the text; None when the tokens are not text of a
    tokenizer."""

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"val_loss": self.val_loss}
        if self.bits_per_byte is not None:
            out["bits_per_byte"] = self.bits_per_byte
        return out


def counted_target_bytes(
    targets: torch.Tensor, byte_lengths: torch.Tensor, head: LanguageHeadConfig
) -> int:
    """The UTF-8 bytes the targets the head counts decode to: byte_lengths[t] summed over
    the counted targets t."""
    counted = counted_target_mask(targets, head)
    flat = targets.reshape(-1).to(byte_lengths.device)
    counted = counted.to(byte_lengths.device)
    return int(byte_lengths[torch.where(counted, flat, 0)][counted].sum())


def bits_per_byte(loss_sum: float, text_bytes: int) -> float:
    """Nats summed over targets -> bits per byte of the text those targets are."""
    return loss_sum / text_bytes / math.log(2)


def evaluate(
    step: EvalLoss,
    data: TokenData,
    block_size: int,
    batch_size: int,
    max_batches: int | None,
    device: torch.device | str = "cpu",
    summary_trigger: SummaryEventTrigger | None = None,
    byte_lengths: np.ndarray | None = None,
    head: LanguageHeadConfig | None = None,
    part: tuple[int, int] = (0, 1),
    add_across_ranks: Callable[[list[float]], list[float]] | None = None,
) -> EvalResult:
    """Every token after the first of the first `max_batches` eval batches, predicted once
    (with their summary event masks when there is a trigger).

    `byte_lengths` ([vocab] UTF-8 bytes per id, `Tokenizer.token_byte_lengths()`) is given
    when `data` is text of that tokenizer: bits per byte is then reported; `head` is the
    model's output head, whose counted targets the bytes are summed over (default: the token
    head).

    With `part = (rank, world)` this process evaluates batches rank, rank + world, ... and
    `add_across_ranks` (an all-reduce SUM over the data-parallel ranks) turns its sums into
    the sums over all batches, so every rank returns the one-process result."""
    head = head if head is not None else LanguageHeadConfig()
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.int64)
    rank, world = part
    total, count, text_bytes = 0.0, 0.0, 0.0
    batches = eval_batches(data, block_size, batch_size, max_batches, summary_trigger)
    for batch in itertools.islice(batches, rank, None, world):
        loss_sum, counted = step.eval_loss(batch.to(device))
        total += loss_sum
        count += counted
        if lengths is not None:
            text_bytes += counted_target_bytes(batch.targets, lengths, head)
    if add_across_ranks is not None:
        total, count, text_bytes = add_across_ranks([total, count, text_bytes])
    if count == 0:  # a mean over nothing is no number, least of all 0.0
        raise DataError(
            f"evaluation counted no tokens ({max_batches} batches of {data.source}); "
            "give at least one batch of data longer than one token"
        )
    val_loss = total / count
    bits = bits_per_byte(total, text_bytes) if lengths is not None and text_bytes else None
    return EvalResult(val_loss, int(count), bits)
