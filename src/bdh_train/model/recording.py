"""Whether autograd records a gradient through a call: the test the chunked executor's
Function, the per-head projections' and the fused gate's share to choose between the Function
(which saves tensors for its backward) and the same arithmetic run bare (evaluation,
generation, frozen inputs: nothing saved)."""

from __future__ import annotations

import torch


def records_gradient(*tensors: torch.Tensor | None) -> bool:
    """True when grad mode is on and any of `tensors` (None entries skipped) requires a
    gradient: autograd will then record an operation on them."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
