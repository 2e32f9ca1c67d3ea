"""Muon: momentum updates orthogonalised by a Newton-Schulz iteration for the model's weight
matrices, AdamW for every other parameter, in one optimizer (one state dict, one checkpoint
part, the same learning rate in every group).

A Muon matrix update: the momentum buffer B <- mu B + (1 - mu) G and its Nesterov look-ahead
U = (1 - mu) G + mu B (as torch.optim.Muon writes them), orthogonalised, O ~ U_s V^T where
U = U_s S V^T is U's SVD; then the decoupled decay W <- (1 - lr wd) W and the step
W <- W - lr * 0.2 * sqrt(max(A, B)) O for an A x B matrix. The factor gives O the root mean
square of a typical AdamW update (Moonshot's "match_rms_adamw" rule, torch.optim.Muon's
`adjust_lr_fn = "match_rms_adamw"`), so one learning rate and one schedule serve both kinds of
group. A stack of matrices [H, A, B] (the per-head encoders [H, D, N]) is H matrices, each
orthogonalised and scaled on its own; the iteration runs on the whole stack at once.

torch.optim.Muon itself takes only 2-D parameters and runs its iteration in bfloat16; this one
runs it in the parameter's dtype (float32 in training), so a step can be checked against a
hand computation to float32's precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients (a, b, c) of torch.optim.Muon and Keller Jordan's
Muon: X <- a X + b (X X^T) X + c (X X^T)^2 X."""
NS_STEPS = 5
"""Newton-Schulz iterations per update."""
NS_EPS = 1e-7
"""Floor of the Frobenius norm the update is divided by before the iteration."""
MUON_PARAMETERS = ("encoder", "encoder_v", "decoder")
"""The BDH parameters Muon updates: the two [H, D, N] encoders (per head) and the
[H * N, D] decoder. Embeddings, heads, norms and decays stay with AdamW."""


def orthogonalise(update: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Each matrix of `update` [..., A, B] orthogonalised by `steps` quintic Newton-Schulz
    iterations: X_0 = M / max(||M||_F, NS_EPS) (of the wide orientation, A <= B), then
    X <- a X + (b X X^T + c (X X^T)^2) X. Singular values land near 1 (roughly in 0.7..1.2,
    the coefficients trade exactness for speed), the singular vectors are M's."""
    a, b, c = NS_COEFFICIENTS
    tall = update.size(-2) > update.size(-1)
    # The wide orientation made contiguous, as a stack [S, A, B], with the sums a X + P X and
    # b G + c G G inside baddbmm: the iteration on a tall matrix's transposed view with the
    # sums as tensors took 1.30x as long for the tiny preset's matrices (bench_muon.py, CPU).
    wide = update.mT if tall else update
    x = wide.reshape(-1, *wide.shape[-2:])
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.reshape(wide.shape)
    return x.mT if tall else x


def rms_scale(shape: Sequence[int]) -> float:
    """0.2 * sqrt(max(A, B)) for matrices A x B (the last two sizes of `shape`)."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class MuonAdamW(torch.optim.AdamW):
    """torch's AdamW for the groups with ``"muon": False``, Muon (this module's docstring)
    for the groups with ``"muon": True``, whose parameters are matrices or stacks of them.

    A Muon group's ``momentum`` is mu; its ``weight_decay`` and the ``lr`` every group shares
    apply as in AdamW (decoupled, lr * weight_decay per step). The AdamW groups step exactly
    as torch.optim.AdamW would step them alone."""

    def __init__(
        self,
        muon_groups: Iterable[dict[str, Any]],
        adamw_groups: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float,
    ) -> None:
        groups = [{**g, "muon": False} for g in adamw_groups]
        groups += [{**g, "muon": True, "momentum": momentum} for g in muon_groups]
        super().__init__(groups, lr=lr, betas=betas, eps=eps)
        for group in self.param_groups:
            if group["muon"] and any(p.dim() < 2 for p in group["params"]):
                raise ValueError("a Muon group holds matrices or stacks of matrices only")

    def _init_group(self, group: dict[str, Any], *lists: Any) -> bool:
        """AdamW's gathering of a group's parameters and state, which skips the Muon groups:
        AdamW's step then has nothing to do for them (and gives them no AdamW state). torch's
        Adam.step gathers every group through this method (private, with this signature from
        torch 2.0 on); were it bypassed, AdamW would step the Muon groups too, and the
        hand-computed Muon tests would fail."""
        if group["muon"]:
            return False  # no complex parameters gathered
        return bool(super()._init_group(group, *lists))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step: Muon on the Muon groups, then AdamW's on the others."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        return super().step()

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, mu, decay = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # a step count as AdamW's state has (its loading reads one)
                state["step"] = torch.tensor(0.0)
                state["momentum_buffer"] = torch.zeros_like(p)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = orthogonalise(p.grad.lerp(buf, mu))
            p.mul_(1 - lr * decay)
            p.add_(update, alpha=-lr * rms_scale(p.shape))
