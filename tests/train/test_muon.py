"""optimizer.name = 'muon' (`train/muon.py`): a step against a Newton-Schulz update written
out by hand in float64, per head for [H, D, N] stacks; the AdamW part against torch's AdamW;
which parameters each part gets; the config's refusals; a bit-exact resume."""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers import assert_same_run, metric_rows

from bdh_train.config import load_config
from bdh_train.errors import ConfigError
from bdh_train.model.bdh import BDH
from bdh_train.model.config import BDHConfig
from bdh_train.train.muon import MuonAdamW
from bdh_train.train.optim import OptimizerConfig
from bdh_train.training.trainer import Trainer

LR, DECAY, MU = 0.05, 0.1, 0.9


def hand_orthogonalised(m: torch.Tensor) -> torch.Tensor:
    """Five quintic Newton-Schulz steps on one matrix in float64, term by term."""
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / torch.sqrt((x * x).sum())
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x - 4.7750 * (a @ x) + 2.0315 * (a @ a @ x)
    return x.T if tall else x


def hand_steps(w0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Muon by hand on one matrix: Nesterov momentum, decoupled decay, the update scaled by
    0.2 sqrt(max(rows, columns))."""
    w, buf = w0.double(), torch.zeros_like(w0, dtype=torch.float64)
    scale = 0.2 * math.sqrt(max(w0.shape))
    for g in grads:
        g = g.double()
        buf = MU * buf + (1 - MU) * g
        look_ahead = (1 - MU) * g + MU * buf
        w = w * (1 - LR * DECAY) - LR * scale * hand_orthogonalised(look_ahead)
    return w


def muon_steps(w0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW(
        [{"params": [w], "weight_decay": DECAY}], [], lr=LR, betas=(0.9, 0.95), eps=1e-8,
        momentum=MU,
    )  # fmt: skip
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


@pytest.mark.parametrize("shape", [(5, 8), (8, 5)], ids=["wide", "tall"])
def test_muon_steps_on_a_matrix_equal_hand_newton_schulz(shape):
    """One step (and a second, through the momentum) equals the update written out in
    float64 to 1e-5."""
    torch.manual_seed(0)
    w0 = torch.randn(shape) * 0.1
    grads = [torch.randn(shape), torch.randn(shape)]
    for n in (1, 2):
        got, want = muon_steps(w0, grads[:n]), hand_steps(w0, grads[:n])
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
        assert (got - w0).abs().max() > 1e-2  # the update is not lost under the tolerance


@pytest.mark.parametrize("shape", [(3, 4, 7), (2, 7, 4)], ids=["wide-heads", "tall-heads"])
def test_muon_on_a_stack_updates_each_head_on_its_own(shape):
    """A [H, D, N] weight: each head's matrix gets its own hand-written update (its own
    normalisation and orthogonalisation), not one of the flattened matrix."""
    torch.manual_seed(1)
    w0 = torch.randn(shape) * 0.1
    grads = [torch.randn(shape), torch.randn(shape)]
    grads[0][0] *= 100  # one loud head: a shared normalisation would mute the others
    got = muon_steps(w0, grads)
    for h in range(shape[0]):
        want = hand_steps(w0[h], [g[h] for g in grads])
        torch.testing.assert_close(got[h].double(), want, rtol=0, atol=1e-5)


def _micro_model() -> BDH:
    torch.manual_seed(0)
    config = BDHConfig(
        n_layer=2, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4, vocab_size=32,
        norm="layernorm_affine",
    )  # fmt: skip
    return BDH(config)


def test_muon_takes_the_encoders_and_decoder_and_adamw_the_rest_exactly():
    """The Muon group holds encoder, encoder_v and decoder; every other parameter steps
    bit-identically to torch.optim.AdamW given the same groups."""
    model, twin = _micro_model(), _micro_model()
    config = OptimizerConfig(name="muon", warmup_steps=0).validate()
    opt = config.build(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]]
    assert sorted(muon) == ["decoder", "encoder", "encoder_v"]
    rest = {n: p for n, p in twin.named_parameters() if n not in muon}
    reference = torch.optim.AdamW(
        [
            {"params": [p for p in rest.values() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in rest.values() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=config.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    params = dict(model.named_parameters())
    for seed in range(2):  # the twin gets the model's gradients (its encoders differ by now)
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
        model(x, x)[1].backward()
        for name, p in rest.items():
            p.grad = params[name].grad.clone()
        opt.step()
        reference.step()
        opt.zero_grad()
    assert set(rest) == {"embed.weight", "lm_head", "norm.weight", "norm.bias"}
    for name, p in rest.items():
        assert torch.equal(params[name], p), name


def test_config_refuses_an_unknown_optimizer_and_muon_under_fsdp():
    with pytest.raises(ConfigError, match=r"optimizer.name must be one of"):
        load_config(overrides=["optimizer.name='sgd'"])
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=["optimizer.name='muon'", "parallel.shard='fsdp'"])
    assert "parallel.shard = 'none'" in str(refused.value)
    assert "\n" not in str(refused.value)


MICRO_MUON = [
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "training.block_size=8",
    "training.batch_size=2",
    "training.log_every=1",
    "training.eval_every=0",
    "training.checkpoint_every=2",
    "training.keep_checkpoints=0",
    "training.max_steps=4",
    "optimizer.name='muon'",
    "optimizer.warmup_steps=2",
    "optimizer.schedule='cosine'",
]


def test_muon_resume_is_bit_exact_and_adamw_cannot_resume_it(tmp_path, monkeypatch):
    """4 steps in one run equal 2 + a resume of 2 (weights and metric rows); resuming the
    Muon checkpoint as AdamW is one ConfigError naming both."""
    monkeypatch.setattr(Trainer, "sample", lambda self, *args: None)  # not under test
    whole, split = tmp_path / "whole", tmp_path / "split"
    Trainer(load_config(overrides=MICRO_MUON), whole, stream=io.StringIO()).run()
    first = Trainer(load_config(overrides=MICRO_MUON), split, stream=io.StringIO())
    first.run(stop_after_micro_steps=2)
    assert first.state.step == 2
    with pytest.raises(
        ConfigError, match=r"optimizer.name = 'adamw', .* holds the state of 'muon'"
    ):
        Trainer(
            load_config(overrides=[*MICRO_MUON, "optimizer.name='adamw'"]),
            split,
            resume=True,
            stream=io.StringIO(),
        )
    Trainer(load_config(overrides=MICRO_MUON), split, resume=True, stream=io.StringIO()).run()
    assert_same_run(whole, split)
    assert len(metric_rows(whole)) == 4
