"""Gradient-scale rules against a small implementation of the reference's formula, written
here from its definition: float32 arithmetic, halves rounded away from zero."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_model

from bdh_train.errors import ConfigError
from bdh_train.train.schedules import (
    GradientScale,
    GradientScaleRamp,
    GradientScaleSchedule,
    ScaleRule,
    validate_gradient_scales,
)


def f32(x: float) -> float:
    """Round a double to the nearest float32 (struct packs with round-to-nearest-even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def reference_index(total_steps: int, fraction: float) -> int:
    """`((last as f32) * fraction.clamp(0, 1)).round() as usize` with f32::round."""
    last = max(total_steps, 1) - 1
    # the product of two float32 values is exact in float64; one rounding makes it float32
    x = f32(f32(float(last)) * f32(min(max(fraction, 0.0), 1.0)))
    whole = int(x)  # x >= 0: truncation is floor
    return whole + 1 if x - whole >= 0.5 else whole  # a half goes away from zero


def reference_scale(initial, final, start, end, index) -> float:
    if index <= start:
        return f32(initial)
    if index >= end or end <= start:
        return f32(final)
    progress = f32(f32(float(index - start)) / f32(float(end - start)))
    initial, final = f32(initial), f32(final)
    return f32(initial + f32(f32(final - initial) * progress))


GRID = [k / 26 for k in range(27)]  # 0, 1/26, ..., 1: 27 fractions, 0.5 among them


def test_step_indices_match_the_reference_on_a_grid():
    """40 totals x 27 start x 27 end fractions = 29,160 rules, every index as the reference's
    (Python's round() in float64 differs on 1,133 of them)."""
    wrong = []
    for total in range(1, 41):
        for start in GRID:
            for end in GRID:
                sched = {"final_scale": 1.0, "start_fraction": start, "end_fraction": end}
                rule = ScaleRule.for_total_steps(0.5, sched, total)
                want = (reference_index(total, start), reference_index(total, end))
                if (rule.start_step_index, rule.end_step_index) != want:
                    wrong.append((total, start, end, rule, want))
    assert not wrong, f"{len(wrong)} of 29160 differ, e.g. {wrong[:3]}"


@pytest.mark.parametrize(
    ("total", "fraction", "index"),
    [(6, 0.5, 3), (2, 0.5, 1), (4, 0.5, 2), (10, 0.5, 5), (1, 0.7, 0), (0, 1.0, 0), (9, 2.0, 8)],
)
def test_halves_round_away_from_zero(total, fraction, index):
    """last * fraction = 2.5 -> 3 (Python's round gives 2), 0.5 -> 1, 4.5 -> 5; clamped."""
    sched = {"final_scale": 1.0, "start_fraction": fraction, "end_fraction": 1.0}
    assert ScaleRule.for_total_steps(1.0, sched, total).start_step_index == index


def test_issue_example_total_six_start_half():
    sched = {"final_scale": 1.0, "start_fraction": 0.5, "end_fraction": 1.0}
    rule = ScaleRule.for_total_steps(0.0, sched, 6)
    assert (rule.start_step_index, rule.end_step_index) == (3, 5)


def test_scales_are_the_reference_float32_values():
    """Interpolated scales whose float64 value is not a float32 come out as the reference's
    float32 arithmetic gives them. From the end index on the scale is final_scale itself: for
    0.7 -> 0.1, float32 initial + (final - initial) * 1 is not float32(0.1)."""
    for initial, final in [(0.1, 0.7), (0.3, 1.0), (1.0, 0.0), (0.123456789, 3.3), (0.7, 0.1)]:
        for total in (7, 13, 40):
            sched = {"final_scale": final, "start_fraction": 0.1, "end_fraction": 0.9}
            rule = ScaleRule.for_total_steps(initial, sched, total)
            start, end = rule.start_step_index, rule.end_step_index
            for index in range(total):
                want = reference_scale(initial, final, start, end, index)
                assert rule.scale_at(index) == want, (initial, final, total, index)


@pytest.mark.parametrize(
    ("scales", "mean"),
    [
        ({"shared_lowrank_decoder": 0.5}, 0.875),
        ({"shared_lowrank_encoder": 0.5}, 0.75),  # encoder and encoder_v: two of four slots
        ({"shared_lowrank_encoder": 0.5, "shared_lowrank_decoder": 0.5}, 0.625),
        ({}, 1.0),
    ],
)
def test_shared_lowrank_target_scale_averages_four_slots(scales, mean):
    """Decay, encoder, encoder_v, decoder: an unset slot counts 1.0 (the model here has no
    learned decay, so that slot is always 1.0)."""
    model = tiny_model()
    rules = [{"target": t, "scale": s} for t, s in scales.items()]
    assert GradientScaleSchedule(model, rules).shared_lowrank_target_lr_scale() == mean


# ------------------------------------------------ the schedule on a model: exact multipliers
def _ones_grads(model) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)


def _grad_values(model) -> dict[str, float]:
    """Each parameter's gradient as one value (the tests fill every entry alike)."""
    values = {}
    for name, p in model.named_parameters():
        assert torch.all(p.grad == p.grad.reshape(-1)[0]), name
        values[name] = p.grad.reshape(-1)[0].item()
    return values


def _steps(schedule, model, count: int) -> list[dict[str, float]]:
    seen = []
    for _ in range(count):
        _ones_grads(model)
        schedule.apply_(list(model.named_parameters()))
        seen.append(_grad_values(model))
    return seen


def test_configured_scales_ramp_per_step_on_their_groups_only():
    """A ramp 0.5 -> 1.5 over total 3 (step indices 0..2: 0.5, 1.0, 1.5) on the decoder, given
    as config dataclasses, and a constant 0.25 on the embedding, given as a table (mapping)."""
    model = tiny_model()
    ramp = GradientScale("shared_lowrank_decoder", 0.5, GradientScaleRamp(1.5, 0.0, 1.0))
    schedule = GradientScaleSchedule(
        model, [ramp, {"target": "embedding", "scale": 0.25}], total_steps=3
    )
    rest = {"encoder": 1.0, "encoder_v": 1.0, "lm_head": 1.0}
    assert _steps(schedule, model, 4) == [
        {**rest, "decoder": d, "embed.weight": 0.25} for d in (0.5, 1.0, 1.5, 1.5)
    ]
    assert schedule.state_dict() == {"step": 4}


def test_default_total_is_one_step():
    """total_steps=1: step indices 0 and 0, so the second step already has the final scale
    (with total 2 the ramp would start at index 1 and the second step keep 0.5)."""
    model = tiny_model()
    rule = GradientScale("shared_lowrank_decoder", 0.5, GradientScaleRamp(2.0, 1.0, 1.0))
    schedule = GradientScaleSchedule(model, [rule])
    assert [g["decoder"] for g in _steps(schedule, model, 2)] == [0.5, 2.0]


def test_backbone_scale_multiplies_the_transferred_backbone_for_its_steps():
    """init_transfer as an object: backbone 0.25 for 2 steps, decoder kept fresh (surface),
    and a configured 0.5 on the encoders: encoders get 0.5 * 0.25 on steps 1-2, then 0.5."""
    model = tiny_model(norm="layernorm_affine")
    transfer = SimpleNamespace(
        backbone_grad_scale=0.25,
        backbone_grad_scale_steps=2,
        preserve_fresh_decoder=True,
        preserve_fresh_norm=False,
    )
    schedule = GradientScaleSchedule(
        model, [{"target": "shared_lowrank_encoder", "scale": 0.5}], transfer
    )
    seen = _steps(schedule, model, 3)
    surface = {"decoder": 1.0, "lm_head": 1.0, "embed.weight": 1.0}
    assert seen == [
        {**surface, "encoder": e, "encoder_v": e, "norm.weight": n, "norm.bias": n}
        for e, n in ((0.125, 0.25), (0.125, 0.25), (0.5, 1.0))
    ]


def test_backbone_scale_from_a_table_without_the_optional_keys():
    """A mapping without preserve_fresh_*: both default to false, so the decoder and the norm
    are backbone; scale 3 for 1 step."""
    model = tiny_model(norm="layernorm_affine")
    transfer = {"backbone_grad_scale": 3.0, "backbone_grad_scale_steps": 1}
    seen = _steps(GradientScaleSchedule(model, [], transfer), model, 2)
    backbone = ("encoder", "encoder_v", "decoder", "norm.weight", "norm.bias")
    assert seen == [
        {"lm_head": 1.0, "embed.weight": 1.0, **{name: s for name in backbone}} for s in (3.0, 1.0)
    ]


def test_backbone_preserve_fresh_norm_from_an_object_without_preserve_fresh_decoder():
    model = tiny_model(norm="layernorm_affine")
    transfer = SimpleNamespace(
        backbone_grad_scale=0.5, backbone_grad_scale_steps=1, preserve_fresh_norm=True
    )
    (first,) = _steps(GradientScaleSchedule(model, [], transfer), model, 1)
    assert first == {
        "encoder": 0.5,
        "encoder_v": 0.5,
        "decoder": 0.5,
        "norm.weight": 1.0,
        "norm.bias": 1.0,
        "lm_head": 1.0,
        "embed.weight": 1.0,
    }


@pytest.mark.parametrize(
    "transfer",
    [
        None,
        {},
        {"backbone_grad_scale": 1.0, "backbone_grad_scale_steps": 5},  # a scale of 1 is none
        {"backbone_grad_scale": 0.5, "backbone_grad_scale_steps": 0},  # for no steps
        {"backbone_grad_scale": 0.5},  # steps default to 0
        {"backbone_grad_scale": None, "backbone_grad_scale_steps": 5},
        SimpleNamespace(backbone_grad_scale=None),
    ],
)
def test_no_backbone_scale(transfer):
    schedule = GradientScaleSchedule(tiny_model(), [], transfer)
    assert (schedule.backbone_scale, schedule.backbone_steps, schedule.backbone) == (
        None,
        0,
        frozenset(),
    )
    assert schedule.step == 0


def test_the_step_counter_resumes_the_curve():
    """Loaded at step 2 of a 0 -> 1 ramp over total 5 (indices 0..4, 0.25 per step): the next
    step is index 2, scale 0.5."""
    model = tiny_model()
    rule = {
        "target": "shared_lowrank_decoder",
        "scale": 0.0,
        "schedule": {"final_scale": 1.0, "start_fraction": 0.0, "end_fraction": 1.0},
    }
    schedule = GradientScaleSchedule(model, [rule], total_steps=5)
    schedule.load_state_dict({"step": 2})
    assert [g["decoder"] for g in _steps(schedule, model, 2)] == [0.5, 0.75]
    assert schedule.state_dict() == {"step": 4}


def test_shared_lowrank_target_scale_is_taken_at_the_last_step_index():
    """A decoder ramp 0 -> 1 over total 5: after 0 steps index 0 (decoder 0, mean 0.75), after
    3 steps index 2 (decoder 0.5, mean 0.875)."""
    model = tiny_model()
    rule = {
        "target": "shared_lowrank_decoder",
        "scale": 0.0,
        "schedule": {"final_scale": 1.0, "start_fraction": 0.0, "end_fraction": 1.0},
    }
    schedule = GradientScaleSchedule(model, [rule], total_steps=5)
    assert schedule.shared_lowrank_target_lr_scale() == 0.75
    schedule.load_state_dict({"step": 3})
    assert schedule.shared_lowrank_target_lr_scale() == 0.875


# ------------------------------------------------------------------ config validation
def test_valid_gradient_scales_pass():
    scales = [
        GradientScale("embedding", 0.0, GradientScaleRamp(2.0, 0.25, 0.25)),
        GradientScale("output_head", 1.5, GradientScaleRamp(0.0, 0.0, 1.0)),
        GradientScale("other_backbone"),
    ]
    validate_gradient_scales(scales, "training.gradient_scales")
    assert GradientScaleRamp().validate("r") == GradientScaleRamp(1.0, 0.0, 1.0)
    assert GradientScale().validate("g") == GradientScale("other_backbone", 1.0, None)


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        ({}, "training.gradient_scales must be a list of tables, got {}"),
        ([{"target": "embedding"}], r"training.gradient_scales\[0\] must be a table, got \{'ta"),
        (
            [GradientScale("embedding"), GradientScale("output_head"), GradientScale("embedding")],
            r"^training.gradient_scales\[2\].target 'embedding' repeats "
            r"training.gradient_scales\[0\]; give each target once$",
        ),
        ([GradientScale("embeding")], r"training.gradient_scales\[0\].target must be one of"),
        ([GradientScale(scale=-0.5)], r"^training.gradient_scales\[0\].scale must be a non-neg"),
        (
            [GradientScale(schedule={"final_scale": 1.0})],
            r"^training.gradient_scales\[0\].schedule must be a table, got \{'final_scale': 1.0\}$",
        ),
        (
            [GradientScale(schedule=GradientScaleRamp(final_scale=-1.0))],
            r"^training.gradient_scales\[0\].schedule.final_scale must be a non-negative number",
        ),
        (
            [GradientScale(schedule=GradientScaleRamp(start_fraction=-0.1))],
            r"^training.gradient_scales\[0\].schedule.start_fraction must be a number in \[0, 1\]",
        ),
        (
            [GradientScale(schedule=GradientScaleRamp(end_fraction=1.5))],
            r"^training.gradient_scales\[0\].schedule.end_fraction must be a number in \[0, 1\], ",
        ),
        (
            [GradientScale(schedule=GradientScaleRamp(1.0, 0.75, 0.5))],
            r"^training.gradient_scales\[0\].schedule.start_fraction \(0.75\) must be <= "
            r"training.gradient_scales\[0\].schedule.end_fraction \(0.5\)$",
        ),
    ],
)
def test_invalid_gradient_scales_are_named(scales, message):
    with pytest.raises(ConfigError, match=message):
        validate_gradient_scales(scales, "training.gradient_scales")


def test_a_fraction_of_exactly_one_is_allowed():
    GradientScaleRamp(1.0, 1.0, 1.0).validate("r")
