"""SequenceBatch: what a loader hands the train step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
"""Targets equal to this are not counted in the loss (padding, masked positions)."""


@dataclass
class SequenceBatch:
    """One block of token windows.

    inputs, targets: LongTensor [B, T]; targets equal to IGNORE_INDEX are not counted.
    reset: optional BoolTensor [B]; a True row starts a fresh sequence (state zeroed,
        position 0) when state is streamed across steps; other rows continue.
    loss_weight: number of counted targets; derived from targets when None.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    reset: torch.Tensor | None = None
    loss_weight: float | None = None

    def __post_init__(self) -> None:
        if self.inputs.dim() != 2 or self.inputs.shape != self.targets.shape:
            raise ValueError(
                f"SequenceBatch needs inputs and targets of the same [B, T] shape, got "
                f"{tuple(self.inputs.shape)} and {tuple(self.targets.shape)}"
            )
        if self.reset is not None and self.reset.shape != (self.inputs.shape[0],):
            raise ValueError(
                f"SequenceBatch.reset must have shape [B]=({self.inputs.shape[0]},), "
                f"got {tuple(self.reset.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.inputs.shape[1])

    def counted_tokens(self) -> float:
        """The weight this batch carries in token-weighted accumulation."""
        if self.loss_weight is not None:
            return float(self.loss_weight)
        return float((self.targets != IGNORE_INDEX).sum().item())

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            self.inputs.to(device),
            self.targets.to(device),
            None if self.reset is None else self.reset.to(device),
            self.loss_weight,
        )

    def rows(self, start: int, end: int) -> SequenceBatch:
        """Rows [start, end) as their own batch (microbatches, DDP shards)."""
        return SequenceBatch(
            self.inputs[start:end],
            self.targets[start:end],
            None if self.reset is None else self.reset[start:end],
            None,
        )

    def time_slice(self, start: int, end: int) -> SequenceBatch:
        """Columns [start, end) (TBPTT chunks); the reset flags go with the first chunk only."""
        return SequenceBatch(
            self.inputs[:, start:end],
            self.targets[:, start:end],
            self.reset if start == 0 else None,
            None,
        )
