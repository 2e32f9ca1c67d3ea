"""`[optimizer]`: AdamW, or Muon for the weight matrices with AdamW for the rest, with warm-up,
a constant, cosine, linear or warmup-stable-decay learning rate, and clipping."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from bdh_train import checks
from bdh_train.errors import ConfigError
from bdh_train.train.muon import MUON_PARAMETERS, MuonAdamW

LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
OPTIMIZERS = ("adamw", "muon")


@dataclass
class OptimizerConfig:
    """AdamW (or Muon for the matrices) with optional warm-up, a learning-rate schedule and
    gradient-norm clipping."""

    lr: float = 1e-3
    """The base learning rate, reached at the end of warm-up."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's two moment decay rates."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices; vectors (norms, biases, decays) get none."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up: step s (0-based) uses lr * (s + 1) / warmup_steps."""
    schedule: str = "constant"
    """After warm-up: 'constant' (lr); 'cosine' or 'linear': from lr toward min_lr, which step
    max_steps (one past the last, 0-based) would reach, as Hugging Face's schedules do;
    'wsd' (warmup-stable-decay): lr until the last decay_fraction of max_steps, then linear
    toward min_lr over those steps, reached at step max_steps like 'linear'. A wsd run
    stopped or checkpointed before its decay can be extended (a larger training.max_steps)
    without a jump in lr: only the decay moves."""
    min_lr: float = 0.0
    """The floor of the 'cosine', 'linear' and 'wsd' schedules (ignored by 'constant')."""
    decay_fraction: float = 0.2
    """'wsd': the share of training.max_steps the final decay takes, round(decay_fraction *
    max_steps) steps (halves up), never starting inside the warm-up; ignored by the other
    schedules."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this; 0 = off."""
    name: str = "adamw"
    """'adamw', or 'muon': Newton-Schulz orthogonalised momentum updates for the encoders (each
    head's [D, N] matrix on its own) and the decoder, scaled to AdamW's update size so lr,
    schedule and weight_decay keep their meaning; AdamW for the embedding, the head, norms and
    decays. Not with parallel.shard = 'fsdp'."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov) for name = 'muon'; betas are AdamW's."""

    def validate(self, prefix: str = "optimizer") -> OptimizerConfig:
        checks.choice(f"{prefix}.name", self.name, OPTIMIZERS)
        checks.number(f"{prefix}.lr", self.lr, low=0.0, low_open=True)
        betas = self.betas
        if (
            not isinstance(betas, (list, tuple))
            or len(betas) != 2
            or not all(checks.is_number(b) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ConfigError(
                f"{prefix}.betas must be a list of two numbers in [0, 1), got {betas!r}"
            )
        checks.number(f"{prefix}.eps", self.eps, low=0.0, low_open=True)
        checks.number(f"{prefix}.weight_decay", self.weight_decay, low=0.0)
        checks.nonneg_int(f"{prefix}.warmup_steps", self.warmup_steps)
        checks.choice(f"{prefix}.schedule", self.schedule, LR_SCHEDULES)
        checks.number(f"{prefix}.min_lr", self.min_lr, low=0.0)
        if self.schedule != "constant" and self.min_lr > self.lr:
            raise ConfigError(
                f"{prefix}.min_lr must be <= {prefix}.lr ({self.lr}) for the {self.schedule} "
                f"schedule, got {self.min_lr}"
            )
        checks.number(
            f"{prefix}.decay_fraction", self.decay_fraction, low=0.0, high=1.0, high_open=False
        )
        checks.number(f"{prefix}.grad_clip_norm", self.grad_clip_norm, low=0.0)
        checks.number(f"{prefix}.muon_momentum", self.muon_momentum, low=0.0, high=1.0)
        return self

    def build(
        self, model: nn.Module, muon_names: Collection[str] = MUON_PARAMETERS
    ) -> torch.optim.AdamW:
        """AdamW over `model`'s trainable parameters, matrices decaying and vectors not; with
        name = 'muon', Muon for the parameters named in `muon_names` (BDH's encoders and
        decoder) instead. A frozen parameter (requires_grad False) is left out: the decoupled
        decay would shrink it at every step, gradient or none."""
        betas = (self.betas[0], self.betas[1])  # validate() checked there are two
        muon: list[nn.Parameter] = []
        rest: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (muon if self.name == "muon" and name in muon_names else rest).append(p)
        groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": self.weight_decay}]
        if any(p.dim() < 2 for p in rest):
            groups.append({"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0})
        if self.name == "muon":
            return MuonAdamW(
                [{"params": muon, "weight_decay": self.weight_decay}],
                groups,
                lr=self.lr,
                betas=betas,
                eps=self.eps,
                momentum=self.muon_momentum,
            )
        return torch.optim.AdamW(groups, lr=self.lr, betas=betas, eps=self.eps)

    def lr_at(self, step: int, total_steps: int) -> float:
        """The learning rate of optimizer step `step` (0-based) of `total_steps`."""
        return learning_rate(
            step,
            self.lr,
            self.warmup_steps,
            total_steps,
            self.schedule,
            self.min_lr,
            self.decay_fraction,
        )

    def clip_norm(self) -> float:
        """The norm `clip_grad_norm_` clips to: infinite (measure only) when clipping is off."""
        return self.grad_clip_norm if self.grad_clip_norm > 0 else math.inf


def learning_rate(
    step: int,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr: float,
    decay_fraction: float = 0.2,
) -> float:
    """Linear warm-up, then constant, or cosine or linear (no restarts) down to min_lr at
    step total_steps, or (wsd) constant until the decay's first step, decay_start(), then
    linear down to min_lr at total_steps; a run's steps are 0 .. total_steps - 1, so its last
    step stays above min_lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    start = warmup_steps
    if schedule == "wsd":
        start = decay_start(warmup_steps, total_steps, decay_fraction)
        if step < start:
            return base_lr
    span = max(total_steps - start, 1)
    progress = min(max(step - start, 0) / span, 1.0)
    if schedule == "cosine":
        return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    return base_lr - (base_lr - min_lr) * progress


def decay_start(warmup_steps: int, total_steps: int, decay_fraction: float) -> int:
    """The wsd schedule's first decay step: total_steps less round(decay_fraction *
    total_steps) (halves up), never inside the warm-up."""
    return max(total_steps - math.floor(decay_fraction * total_steps + 0.5), warmup_steps)
