"""Summary events: where a write trigger occurs in a row of input tokens.

`mask[t] = 1` iff the k tokens ending at input t equal the trigger sequence (k its length),
or input t is one of the trigger ids. The k tokens must all belong to the sequence the model
has read since its state was last reset: the row's window for random and evaluation windows,
the document so far for streamed documents (whose loader passes the tokens before the window
as `history`). The mask is a pure function of the tokens, so it adds nothing to loader state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdh_train.model.summary import NO_TOKEN


@dataclass(frozen=True)
class SummaryEventTrigger:
    """The events that open the summary memory's write gate."""

    sequence: tuple[int, ...] = ()
    """Token ids whose consecutive occurrence ends an event at its last token (() = none)."""
    ids: tuple[int, ...] = ()
    """Token ids each of which is an event on its own (() = none)."""

    @property
    def history_len(self) -> int:
        """How many tokens before a window the sequence match may need."""
        return max(len(self.sequence) - 1, 0)

    def mask(self, inputs: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """Bool [B, T] events for input rows [B, T]; `history` [B, history_len] holds the
        tokens just before each row (NO_TOKEN where the row's sequence had not begun; None =
        every row begins at its first input)."""
        batch, seq_len = inputs.shape
        out = torch.zeros(batch, seq_len, dtype=torch.bool, device=inputs.device)
        if self.ids:
            ids = torch.tensor(self.ids, dtype=inputs.dtype, device=inputs.device)
            out |= torch.isin(inputs, ids)
        if self.sequence:
            k = len(self.sequence)
            if history is None:
                history = torch.full(
                    (batch, k - 1), NO_TOKEN, dtype=inputs.dtype, device=inputs.device
                )
            if history.shape != (batch, k - 1):
                raise ValueError(
                    f"history must be [B, {k - 1}]=({batch}, {k - 1}), got {tuple(history.shape)}"
                )
            padded = torch.cat([history.to(inputs), inputs], dim=1)  # [B, k - 1 + T]
            windows = padded.unfold(1, k, 1)  # [B, T, k]: the k tokens ending at each input
            target = torch.tensor(self.sequence, dtype=inputs.dtype, device=inputs.device)
            out |= (windows == target).all(-1)
        return out
