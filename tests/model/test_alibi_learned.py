"""model.position = "alibi_learned": alibi's per-head decay with each head's rate learned
(log d_h = -slope_h * exp(decay_log_gain_h)), and the shared_lowrank_decay gradient scale.

Executor agreement, the float64 reference and generation with learned rates away from alibi's
are covered with the other positions in test_model_executors.py, test_model_reference.py and
test_model_generate.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import save_file

from bdh_train.batch import SequenceBatch
from bdh_train.config import load_config
from bdh_train.errors import ConfigError
from bdh_train.model import BDH, sampling
from bdh_train.model.mixer import EXECUTORS
from bdh_train.model.positions import (
    alibi_log_decay,
    learned_alibi_log_decay,
    rope_frequencies,
)
from bdh_train.storage import checkpoint as ckpt
from bdh_train.train.init_from import InitTransferConfig, init_weights_from
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.step import LanguageTrainModel

FIXTURE_V0_1 = Path(__file__).parents[1] / "fixtures" / "checkpoint_v0_1"


def batch(seed=0, b=2, t=12):
    g = torch.Generator().manual_seed(seed)
    return SequenceBatch(
        torch.randint(0, 32, (b, t), generator=g), torch.randint(0, 32, (b, t), generator=g)
    )


def twins(**overrides):
    """An alibi model and an alibi_learned model with the same weights."""
    alibi = tiny_model(position="alibi", **overrides)
    learned = tiny_model(position="alibi_learned", **overrides)
    learned.load_state_dict({**alibi.state_dict(), "decay_log_gain": learned.decay_log_gain})
    return alibi, learned


@pytest.mark.parametrize("executor", EXECUTORS)
def test_at_init_equals_alibi_bit_for_bit(executor):
    """Fresh gains are zero and exp(0) * slope is the slope exactly: without gradients
    (both run one form) logits, loss and the carried state over two calls are bit-identical
    to alibi's, and so is generation. With gradients recorded the learned decay runs the
    products autograd differentiates (its gain needs a gradient) and alibi the hand-written
    Function where it applies: the same values to fp32 rounding (1e-6)."""
    alibi, learned = twins(executor=executor, chunk_size=3)
    assert torch.equal(learned.decay_log_gain, torch.zeros(2))
    assert torch.equal(learned_alibi_log_decay(learned.decay_log_gain), alibi_log_decay(2))
    b = batch()
    for recorded in (False, True):
        outs = []
        for model in (alibi, learned):
            with torch.set_grad_enabled(recorded):
                state = model.init_state(2)
                model.forward_hidden(b.inputs[:, :5], state)
                logits, loss = model(b.inputs[:, 5:], b.targets[:, 5:], state)
            outs.append((logits, loss, state.rho))
        for a, c in zip(
            (outs[0][0], outs[0][1], *outs[0][2]),
            (outs[1][0], outs[1][1], *outs[1][2]),
            strict=True,
        ):
            if recorded:
                torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(a, c)
    prompt = b.inputs[:, :4]
    sampled = [
        sampling.generate(m.eval(), prompt, 8, top_k=5, generator=torch.Generator().manual_seed(3))
        for m in (alibi, learned)
    ]
    assert torch.equal(sampled[0], sampled[1])


def test_every_head_gets_a_gradient_and_stays_negative_while_training():
    """The gains receive a gradient per head; after Adam steps at a large learning rate they
    have moved, and every head's log-decay is still negative and finite."""
    model = tiny_model(position="alibi_learned")
    step = LanguageTrainModel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.3)
    for i in range(15):
        step.train_step(batch(seed=i))
        if i == 0:
            assert (model.decay_log_gain.grad.abs() > 0).all(), model.decay_log_gain.grad
        optimizer.step()
    gains = model.decay_log_gain.detach()
    assert (gains.abs() > 0.01).all(), f"the gains hardly moved: {gains}"
    log_decay = learned_alibi_log_decay(gains)
    assert torch.isfinite(log_decay).all() and (log_decay < 0).all(), log_decay


def test_extreme_gains_keep_a_decay_strictly_between_zero_and_one():
    """The parametrisation has no boundary: gains far out on either side still give
    0 < d < 1 per head and a finite model output."""
    model = tiny_model(torch.float64, position="alibi_learned")
    with torch.no_grad():
        model.decay_log_gain.copy_(torch.tensor([-30.0, 6.0]))
    log_decay = learned_alibi_log_decay(model.decay_log_gain)
    assert (log_decay < 0).all() and torch.isfinite(log_decay).all()
    decay = torch.exp(log_decay)
    assert ((decay > 0) & (decay < 1)).all(), decay
    logits, loss = model(batch().inputs, batch().targets)
    assert torch.isfinite(logits).all() and torch.isfinite(loss)


def test_shared_lowrank_decay_scale_multiplies_only_the_decay_gradient():
    model = tiny_model(position="alibi_learned")
    b = batch()
    LanguageTrainModel(model).train_step(b)
    base = {n: p.grad.clone() for n, p in model.named_parameters()}
    rules = [{"target": "shared_lowrank_decay", "scale": 0.5}]
    step = LanguageTrainModel(model, gradient_scales=GradientScaleSchedule(model, rules))
    step.train_step(b)
    for name, param in model.named_parameters():
        want = base[name] * 0.5 if name == "decay_log_gain" else base[name]
        assert torch.equal(param.grad, want), name


def test_reference_schedule_case_with_the_decay_target():
    """The reference's schedule test: encoder, decoder and decay at 0.5 ramping to 1.0 over
    two steps. The four-slot target scale is 0.5 before and 1.0 after; the decay gradient is
    halved at the first step and whole at the second."""
    model = tiny_model(position="alibi_learned")
    ramp = {"final_scale": 1.0, "start_fraction": 0.0, "end_fraction": 1.0}
    rules = [
        {"target": t, "scale": 0.5, "schedule": ramp}
        for t in ("shared_lowrank_encoder", "shared_lowrank_decoder", "shared_lowrank_decay")
    ]
    step = LanguageTrainModel(model, gradient_scales=GradientScaleSchedule(model, rules, None, 2))
    assert step.gradient_scales.shared_lowrank_target_lr_scale() == 0.5
    b = batch()
    LanguageTrainModel(model).train_step(b)
    base = model.decay_log_gain.grad.clone()
    step.train_step(b)
    assert torch.equal(model.decay_log_gain.grad, base * 0.5)
    step.train_step(b)
    assert torch.equal(model.decay_log_gain.grad, base)
    assert step.gradient_scales.shared_lowrank_target_lr_scale() == 1.0


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_old_checkpoint_without_the_parameter_loads_for_rope_and_alibi(position):
    """A model.safetensors written by v0.1 (before alibi_learned and the rope table) loads
    strictly; a rope model gets the table v0.1 computed from N."""
    cfg = load_config([FIXTURE_V0_1 / "config.toml"], default_preset=False).model
    model = BDH(dataclasses.replace(cfg, position=position))
    if position == "rope":
        model.rope_freqs.zero_()  # the load must fill it
    where = next((FIXTURE_V0_1 / "checkpoints").glob("step-*"))
    weights = ckpt.load_model_weights(where)
    ckpt.load_into_model(model, weights, where)
    for name, tensor in model.state_dict().items():
        if name == "rope_freqs":
            assert torch.equal(tensor, rope_frequencies(cfg.n_neurons)), name
        else:
            assert torch.equal(tensor, weights[name]), name


def test_alibi_weights_start_an_alibi_learned_run_at_alibi(tmp_path):
    """init_from an alibi checkpoint: the gains stay fresh (zero), so the new model computes
    exactly what the alibi model did."""
    alibi = tiny_model(position="alibi")
    save_file(alibi.state_dict(), str(tmp_path / ckpt.MODEL_FILE))
    ckpt.write_manifest(tmp_path)  # a checkpoint directory has one
    learned = tiny_model(seed=5, position="alibi_learned")
    fresh = init_weights_from(learned, InitTransferConfig(), tmp_path)
    assert fresh == ["decay_log_gain"]
    b = batch()
    assert torch.equal(learned(b.inputs)[0], alibi(b.inputs)[0])


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_decay_scale_without_a_learned_decay_is_refused(position):
    scales = 'training.gradient_scales=[{target="shared_lowrank_decay", scale=0.5}]'
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"model.position={position}", scales])
    assert str(info.value) == (
        "training.gradient_scales[0].target = 'shared_lowrank_decay' scales the learned "
        "per-head decay, which only model.position = 'alibi_learned' gives the model; got "
        f"model.position = '{position}'"
    )
    cfg = load_config(overrides=["model.position=alibi_learned", scales])
    assert cfg.training.gradient_scales[0].target == "shared_lowrank_decay"
