"""Gradient-scale schedules (spec §7) and learning-rate schedules.

A gradient scale multiplies a parameter group's gradient after backward; it is not a
learning-rate change (with Adam the two differ). The step counter lives in the schedule's
state_dict so a resumed run continues the same curve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bdh_train.model import groups

_EPS = 1.1920929e-07  # f32::EPSILON, as in the seed


@dataclass(frozen=True)
class ScaleRule:
    """Scale initial_scale up to start, final_scale from end, linear in between."""

    initial_scale: float
    final_scale: float
    start_step_index: int = 0
    end_step_index: int = 0

    @classmethod
    def constant(cls, scale: float) -> ScaleRule:
        return cls(scale, scale)

    @classmethod
    def for_total_steps(
        cls, initial_scale: float, schedule: Any | None, total_steps: int
    ) -> ScaleRule:
        """`schedule` has final_scale, start_fraction, end_fraction (attributes or keys)."""
        if schedule is None:
            return cls.constant(initial_scale)

        def get(key: str) -> float:
            return schedule[key] if isinstance(schedule, Mapping) else getattr(schedule, key)

        last = max(total_steps, 1) - 1
        start = round(last * min(max(get("start_fraction"), 0.0), 1.0))
        end = round(last * min(max(get("end_fraction"), 0.0), 1.0))
        return cls(initial_scale, get("final_scale"), start, end)

    def scale_at(self, step_index: int) -> float:
        if step_index <= self.start_step_index:
            return self.initial_scale
        if step_index >= self.end_step_index or self.end_step_index <= self.start_step_index:
            return self.final_scale
        progress = (step_index - self.start_step_index) / (
            self.end_step_index - self.start_step_index
        )
        return self.initial_scale + (self.final_scale - self.initial_scale) * progress


def _get(entry: Any, key: str, default: Any = None) -> Any:
    if isinstance(entry, Mapping):
        return entry.get(key, default)
    return getattr(entry, key, default)


class GradientScaleSchedule:
    """Per-parameter gradient multipliers from `module_lr_scales` and `init_transfer`."""

    def __init__(
        self,
        model: nn.Module,
        module_lr_scales: Sequence[Any] = (),
        init_transfer: Any | None = None,
        total_steps: int = 1,
    ):
        self.rules: dict[str, ScaleRule] = {}
        for entry in module_lr_scales:
            rule = ScaleRule.for_total_steps(
                float(_get(entry, "scale")), _get(entry, "schedule"), total_steps
            )
            for name in groups.params_for_target(model, _get(entry, "target")):
                self.rules[name] = rule
        self.shared_lowrank = groups.shared_lowrank_params(model)
        self.backbone_scale: float | None = None
        self.backbone_steps = 0
        self.backbone: frozenset[str] = frozenset()
        scale = _get(init_transfer, "backbone_grad_scale") if init_transfer is not None else None
        steps = _get(init_transfer, "backbone_grad_scale_steps", 0) if init_transfer else 0
        if scale is not None and steps and abs(scale - 1.0) > _EPS:
            self.backbone_scale = float(scale)
            self.backbone_steps = int(steps)
            self.backbone = frozenset(
                groups.transferred_backbone_params(
                    model,
                    bool(_get(init_transfer, "preserve_fresh_decoder", False)),
                    bool(_get(init_transfer, "preserve_fresh_norm", False)),
                )
            )
        self.step = 0  # train steps taken

    def scale_for(self, name: str, step_index: int, step: int) -> float:
        scale = self.rules.get(name, ScaleRule.constant(1.0)).scale_at(step_index)
        if (
            self.backbone_scale is not None
            and step <= self.backbone_steps
            and (name in self.backbone)
        ):
            scale *= self.backbone_scale
        return scale

    @torch.no_grad()
    def apply_(self, named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Scale the .grad of each parameter for this step, then advance the counter."""
        self.step += 1
        step_index = self.step - 1
        for name, param in named_params:
            scale = self.scale_for(name, step_index, self.step)
            if param.grad is not None and abs(scale - 1.0) > _EPS:
                param.grad.mul_(scale)

    def shared_lowrank_target_lr_scale(self) -> float:
        """Mean scale over the shared low-rank parameters at the last step taken (the seed's
        continual-backprop target scale); before any step, at step index 0."""
        if not self.shared_lowrank:
            return 1.0
        index = max(self.step - 1, 0)
        rules = [self.rules.get(n, ScaleRule.constant(1.0)) for n in self.shared_lowrank]
        return sum(r.scale_at(index) for r in rules) / len(rules)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: Mapping[str, int]) -> None:
        self.step = int(sd["step"])


def learning_rate(
    step: int, base_lr: float, warmup_steps: int, total_steps: int, schedule: str, min_lr: float
) -> float:
    """Linear warm-up, then constant or cosine (no restarts) down to min_lr at total_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
