"""Gradient-scale rules against a small implementation of the reference's formula, written
here from its definition: float32 arithmetic, halves rounded away from zero."""

from __future__ import annotations

import struct

import pytest
from helpers import tiny_model

from bdh_train.train.schedules import GradientScaleSchedule, ScaleRule


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
    float32 arithmetic gives them."""
    for initial, final in [(0.1, 0.7), (0.3, 1.0), (1.0, 0.0), (0.123456789, 3.3)]:
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
