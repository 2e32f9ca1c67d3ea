"""Gradient-scale schedules: `training.gradient_scales` and the init-transfer backbone scale.

A gradient scale multiplies a parameter group's gradient after backward; it is not a
learning-rate change (with Adam the two differ). The counter advances once per `apply_`: once
per optimizer step in the Trainer (whatever the accumulation count), once per `train_step` call
of a bare LanguageTrainModel. It lives in the schedule's state_dict, so a resumed run continues
the same curve.

Step indices and scales are computed in float32 with halves rounded away from zero, as the
Rust reference does, so both pick the same steps and multiply by the same float32 scale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from bdh_train import checks
from bdh_train.errors import ConfigError
from bdh_train.model import groups

_EPS = 1.1920929e-07
"""float32 machine epsilon: scales this close to 1 are treated as 1 (no multiply)."""


@dataclass
class GradientScaleRamp:
    """Move a group's gradient scale from `GradientScale.scale` to `final_scale` linearly
    between two fractions of training (e.g. unfreeze a transferred backbone gradually)."""

    final_scale: float = 1.0
    """The scale from end_fraction on."""
    start_fraction: float = 0.0
    """Where the ramp leaves the initial scale, as a fraction of training.max_steps (optimizer
    steps): step index round((max_steps - 1) * start_fraction)."""
    end_fraction: float = 1.0
    """Where the ramp reaches final_scale, as a fraction of training.max_steps."""

    def validate(self, prefix: str) -> GradientScaleRamp:
        checks.number(f"{prefix}.final_scale", self.final_scale, low=0.0)
        for name in ("start_fraction", "end_fraction"):
            checks.number(
                f"{prefix}.{name}", getattr(self, name), low=0.0, high=1.0, high_open=False
            )
        if self.start_fraction > self.end_fraction:
            raise ConfigError(
                f"{prefix}.start_fraction ({self.start_fraction}) must be <= "
                f"{prefix}.end_fraction ({self.end_fraction})"
            )
        return self


@dataclass
class GradientScale:
    """Multiply the gradients of one parameter group (`target`) by `scale` after backward."""

    target: str = "other_backbone"
    """A parameter group: one of model.groups.TARGETS."""
    scale: float = 1.0
    """The multiplier (with a schedule: the ramp's initial scale)."""
    schedule: GradientScaleRamp | None = None
    """Optional ramp of the scale over training."""

    def validate(self, prefix: str) -> GradientScale:
        checks.choice(f"{prefix}.target", self.target, groups.TARGETS)
        checks.number(f"{prefix}.scale", self.scale, low=0.0)
        if self.schedule is not None:
            if not isinstance(self.schedule, GradientScaleRamp):
                raise ConfigError(f"{prefix}.schedule must be a table, got {self.schedule!r}")
            self.schedule.validate(f"{prefix}.schedule")
        return self


def validate_gradient_scales(scales: Any, prefix: str) -> None:
    """A list of GradientScale tables, each target at most once."""
    if not isinstance(scales, list):
        raise ConfigError(f"{prefix} must be a list of tables, got {scales!r}")
    seen: dict[str, int] = {}
    for i, item in enumerate(scales):
        where = f"{prefix}[{i}]"
        if not isinstance(item, GradientScale):
            raise ConfigError(f"{where} must be a table, got {item!r}")
        item.validate(where)
        if item.target in seen:
            raise ConfigError(
                f"{where}.target {item.target!r} repeats {prefix}[{seen[item.target]}]; give "
                "each target once"
            )
        seen[item.target] = i


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
        start = _step_index_f32(last, get("start_fraction"))
        end = _step_index_f32(last, get("end_fraction"))
        return cls(initial_scale, get("final_scale"), start, end)

    def scale_at(self, step_index: int) -> float:
        """The scale at a step index, computed in float32 (returned as the float32 value)."""
        if step_index <= self.start_step_index:
            return _f32(self.initial_scale)
        if step_index >= self.end_step_index or self.end_step_index <= self.start_step_index:
            return _f32(self.final_scale)
        progress = np.float32(step_index - self.start_step_index) / np.float32(
            self.end_step_index - self.start_step_index
        )
        initial = np.float32(self.initial_scale)
        return float(initial + (np.float32(self.final_scale) - initial) * progress)


def _f32(value: float) -> float:
    """The nearest float32 to `value`, as a Python float."""
    return float(np.float32(value))


def _step_index_f32(last_step_index: int, fraction: float) -> int:
    """round(last_step_index * clamp(fraction, 0, 1)) with a float32 product and halves rounded
    away from zero (Rust's f32::round): total 6, fraction 0.5 gives 3, where Python's round()
    (halves to even) gives 2."""
    product = np.float32(last_step_index) * np.float32(min(max(fraction, 0.0), 1.0))
    # product >= 0 and float32, so product + 0.5 is exact in float64 and floor rounds halves up
    return math.floor(float(product) + 0.5)


def _get(entry: Any, key: str, default: Any = None) -> Any:
    if isinstance(entry, Mapping):
        return entry.get(key, default)
    return getattr(entry, key, default)


class GradientScaleSchedule:
    """Per-parameter gradient multipliers from `gradient_scales` and `init_transfer`."""

    def __init__(
        self,
        model: nn.Module,
        gradient_scales: Sequence[Any] = (),
        init_transfer: Any | None = None,
        total_steps: int = 1,
    ):
        self.rules: dict[str, ScaleRule] = {}
        for entry in gradient_scales:
            rule = ScaleRule.for_total_steps(
                float(_get(entry, "scale")), _get(entry, "schedule"), total_steps
            )
            for name in groups.params_for_target(model, _get(entry, "target")):
                self.rules[name] = rule
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
            scale = float(np.float32(scale) * np.float32(self.backbone_scale))
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
        """Mean scale over the four shared low-rank slots (groups.SHARED_LOWRANK: the learned
        decay, encoder, encoder_v, decoder) at the last step taken, before any step at step
        index 0 (the continual-backprop target scale). A slot without a rule, or that this
        model lacks, counts 1.0; summed and divided in float32."""
        index = max(self.step - 1, 0)
        total = np.float32(0.0)
        for name in groups.SHARED_LOWRANK:
            total += np.float32(self.rules.get(name, ScaleRule.constant(1.0)).scale_at(index))
        return float(total / np.float32(len(groups.SHARED_LOWRANK)))

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: Mapping[str, int]) -> None:
        self.step = int(sd["step"])
