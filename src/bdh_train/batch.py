"""The vocabulary every layer shares: the batch a loader hands a train step, what a step
hands back, and the target id that is never counted in a loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE_INDEX = -100
"""Targets equal to this are not counted in the loss (padding, masked positions)."""


@dataclass
class SequenceBatch:
    """One block of token windows.

    inputs, targets: LongTensor [B, T]; targets equal to IGNORE_INDEX are not counted.
    reset: optional BoolTensor, [B] or [B, T]. [B, T] is True where a new document begins
        at that position: the row's state from before it is dropped (the carried state and
        every earlier token) and the document's positions restart at 0. [B] is the short form
        of a mask whose only True entries are in column 0 (a row starting afresh at the
        block's first token); `reset_mask` converts it. Other rows continue.
    summary_event_mask: optional [B, T], bool or 0/1; nonzero where a summary event ends at
        that input token (what the summary memory's write gate reads; ignored without one).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    reset: torch.Tensor | None = None
    summary_event_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.inputs.dim() != 2 or self.inputs.shape != self.targets.shape:
            raise ValueError(
                f"SequenceBatch needs inputs and targets of the same [B, T] shape, got "
                f"{tuple(self.inputs.shape)} and {tuple(self.targets.shape)}"
            )
        if self.reset is not None and self.reset.shape not in (
            self.inputs.shape[:1],
            self.inputs.shape,
        ):
            raise ValueError(
                f"SequenceBatch.reset must have shape [B]=({self.inputs.shape[0]},) or "
                f"[B, T]={tuple(self.inputs.shape)}, got {tuple(self.reset.shape)}"
            )
        mask = self.summary_event_mask
        if mask is not None and mask.shape != self.inputs.shape:
            raise ValueError(
                f"SequenceBatch.summary_event_mask must have the inputs' shape [B, T]="
                f"{tuple(self.inputs.shape)}, got {tuple(mask.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def reset_mask(self) -> torch.Tensor | None:
        """The reset flags as a [B, T] bool mask (a [B] `reset` fills column 0), or None."""
        if self.reset is None or self.reset.dim() == 2:
            return None if self.reset is None else self.reset.to(torch.bool)
        mask = torch.zeros(self.inputs.shape, dtype=torch.bool, device=self.reset.device)
        mask[:, 0] = self.reset.to(torch.bool)
        return mask

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            self.inputs.to(device),
            self.targets.to(device),
            None if self.reset is None else self.reset.to(device),
            _maybe(self.summary_event_mask, lambda m: m.to(device)),
        )

    def rows(self, start: int, end: int) -> SequenceBatch:
        """Rows [start, end) as their own batch (microbatches, DDP shards)."""
        return SequenceBatch(
            self.inputs[start:end],
            self.targets[start:end],
            None if self.reset is None else self.reset[start:end],
            _maybe(self.summary_event_mask, lambda m: m[start:end]),
        )

    def time_slice(self, start: int, end: int) -> SequenceBatch:
        """Columns [start, end) (TBPTT chunks), the summary event and reset masks with them
        (a [B] reset goes with the first chunk only)."""
        if self.reset is None or self.reset.dim() == 2:
            reset = _maybe(self.reset, lambda m: m[:, start:end])
        else:
            reset = self.reset if start == 0 else None
        return SequenceBatch(
            self.inputs[:, start:end],
            self.targets[:, start:end],
            reset,
            _maybe(self.summary_event_mask, lambda m: m[:, start:end]),
        )


def _maybe(tensor: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]):
    return None if tensor is None else fn(tensor)


@dataclass
class StepOutput:
    """What one train step reports: `loss`, the block's mean loss over counted targets
    (detached), `counted`, that count (the targets the model's head counts: the block's weight
    in token-weighted accumulation), and optional `stats` (e.g. a step profile)."""

    loss: torch.Tensor
    counted: float
    stats: dict[str, Any] = field(default_factory=dict)
