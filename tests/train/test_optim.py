"""The learning-rate schedule (`schedules.learning_rate`) against hand-computed values, and
the optimizer's parameter groups (what decays, what is frozen).

`step` is the 0-based index of the optimizer step about to be taken (the trainer passes the
number of steps already taken). Base and floor are powers of two so every warm-up value and
both cosine end points are exact in binary floating point.
"""

from __future__ import annotations

import math

import pytest

from bdh_train.errors import ConfigError
from bdh_train.train.optim import OptimizerConfig, decay_start, learning_rate

BASE = 2.0**-8  # 0.00390625
FLOOR = 2.0**-10  # 0.0009765625


def lr_at(step: int, warmup: int, total: int, schedule: str) -> float:
    return learning_rate(
        step=step,
        base_lr=BASE,
        warmup_steps=warmup,
        total_steps=total,
        schedule=schedule,
        min_lr=FLOOR,
    )


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_first_warmup_step_is_base_over_warmup_and_base_is_reached_at_step_index_warmup_minus_1(
    schedule,
):
    warmup, total = 4, 12
    lrs = [lr_at(s, warmup, total, schedule) for s in range(warmup + 1)]
    # Hand computation: the k-th step (index k-1) of a 4-step warm-up runs at k/4 of the base.
    assert lrs[0] == BASE / 4 == 0.0009765625
    assert lrs[:warmup] == [BASE / 4, BASE / 2, 3 * BASE / 4, BASE]
    # The base rate is first reached by the 4th step (index 3), never before it ...
    assert [i for i, lr in enumerate(lrs) if lr == BASE][0] == warmup - 1
    # ... and the first step after the warm-up (index 4) also runs at the base rate.
    assert lrs[warmup] == BASE
    # Without warm-up the very first step already uses the base rate.
    assert lr_at(0, 0, total, schedule) == BASE


def test_cosine_is_base_right_after_warmup_and_min_lr_at_total_steps():
    warmup, total = 2, 6  # the cosine spans step indices 2..6 (4 intervals)
    lr = [lr_at(s, warmup, total, "cosine") for s in range(total + 3)]
    assert lr[warmup] == BASE  # progress 0: cos(0) = 1
    # progress 1/4, 2/4, 3/4: floor + (base - floor) * (1 + cos(pi p)) / 2, by hand
    span = BASE - FLOOR
    assert lr[3] == pytest.approx(FLOOR + span * (2 + math.sqrt(2)) / 4, rel=1e-13, abs=0)
    assert lr[4] == pytest.approx(FLOOR + span / 2, rel=1e-13, abs=0)
    assert lr[5] == pytest.approx(FLOOR + span * (2 - math.sqrt(2)) / 4, rel=1e-13, abs=0)
    assert lr[total] == FLOOR  # progress 1: exactly the floor at total_steps ...
    assert lr[total - 1] > FLOOR  # ... not one step earlier ...
    assert lr[total + 1] == lr[total + 2] == FLOOR  # ... and it stays there (no restart)
    assert all(a > b for a, b in zip(lr[warmup:total], lr[warmup + 1 : total + 1], strict=True))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_frozen_parameters_are_in_no_group_and_only_matrices_decay(name: str) -> None:
    """Every trainable parameter in exactly one group: matrices with the weight decay,
    vectors (the affine norm, decay gains) with none, Muon's matrices in its own group; a
    frozen one (a matrix, a Muon matrix, a vector) in none."""
    from helpers import tiny_model

    from bdh_train.train.muon import MUON_PARAMETERS
    from bdh_train.train.optim import OptimizerConfig

    model = tiny_model(norm="layernorm_affine", position="alibi_learned")
    frozen = {"embed.weight", "encoder", "norm.bias"}
    for key in frozen:
        model.get_parameter(key).requires_grad_(False)
    optimizer = OptimizerConfig(name=name, weight_decay=0.25).build(model)
    where: dict[str, list[tuple[float, bool]]] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            where.setdefault(names[id(p)], []).append(
                (group["weight_decay"], group.get("muon", False))
            )
    trainable = {n: p for n, p in model.named_parameters() if n not in frozen}
    assert sorted(where) == sorted(trainable) and "decay_log_gain" in trainable
    for n, p in trainable.items():
        muon = name == "muon" and n in MUON_PARAMETERS
        assert where[n] == [(0.25 if p.dim() >= 2 else 0.0, muon)], n


def test_linear_falls_from_base_after_warmup_to_min_lr_at_total_steps():
    warmup, total = 2, 6  # the line spans step indices 2..6 (4 intervals)
    lr = [lr_at(s, warmup, total, "linear") for s in range(total + 2)]
    span = BASE - FLOOR  # 3 * 2**-10, so every quarter of it is exact
    assert lr[:warmup] == [BASE / 2, BASE]
    assert lr[2:] == [BASE, BASE - span / 4, BASE - span / 2, BASE - 3 * span / 4, FLOOR, FLOOR]


def wsd_at(step: int, total: int, warmup: int = 2, fraction: float = 0.25) -> float:
    return learning_rate(step, BASE, warmup, total, "wsd", FLOOR, fraction)


def test_wsd_is_warmup_then_base_then_a_linear_decay_over_its_share_of_the_steps():
    """12 steps, a quarter of them decay: round(3.0) = 3 decay steps from step index 9,
    reaching the floor at step 12; 10 steps: round(2.5) = 3 (halves up) from index 7."""
    lr = [wsd_at(s, 12) for s in range(13)]
    span = BASE - FLOOR
    assert lr[:2] == [BASE / 2, BASE]
    assert lr[2:10] == [BASE] * 8  # stable, the decay's first step included
    assert lr[10] == pytest.approx(BASE - span / 3, rel=1e-15)
    assert lr[11] == pytest.approx(BASE - 2 * span / 3, rel=1e-15)
    assert lr[12] == FLOOR
    assert [s for s in range(10) if wsd_at(s, 10) < BASE and s >= 2] == [8, 9]
    assert decay_start(2, 10, 0.25) == 7 and decay_start(2, 12, 0.25) == 9
    assert decay_start(6, 8, 1.0) == 6  # the decay never starts inside the warm-up
    assert [wsd_at(s, 8, 2, 0.0) for s in range(8)] == [BASE / 2] + [BASE] * 7  # no decay


def test_an_extended_wsd_run_keeps_its_lr_through_the_old_stable_phase():
    """Doubling a wsd run's length moves only its decay: every step before the old decay has
    the same lr, while a cosine run's lr at those steps jumps up (re-stretched)."""
    for step in range(10):
        assert wsd_at(step, 12) == wsd_at(step, 24)
    assert lr_at(6, 2, 24, "cosine") > lr_at(6, 2, 12, "cosine")


def test_the_decay_fraction_is_a_share():
    OptimizerConfig(schedule="wsd", decay_fraction=1.0).validate()
    with pytest.raises(ConfigError, match=r"optimizer.decay_fraction must be .*got 1.5"):
        OptimizerConfig(schedule="wsd", decay_fraction=1.5).validate()
    with pytest.raises(ConfigError, match=r"min_lr must be <= optimizer.lr \(0.001\) for the wsd"):
        OptimizerConfig(schedule="wsd", min_lr=0.01).validate()
