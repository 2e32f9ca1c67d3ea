"""The model against an independent float64 implementation written from the model's formulas,
token by token. Tolerance 1e-10."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_model

from bdh_train.model.mixer import EXECUTORS
from bdh_train.model.positions import position_log_decay


def spec_reference(
    weights: dict, idx: torch.Tensor, n_layer: int, position: str, start: int = 0, rho0=None
):
    """Straight from bdh.md: returns (logits [B,T,V], final rho per layer)."""
    enc, enc_v, dec = weights["encoder"], weights["encoder_v"], weights["decoder"]
    emb, head = weights["embed.weight"], weights["lm_head"]
    H, D, N = enc.shape

    def ln(z):
        mu = z.mean(-1, keepdim=True)
        var = ((z - mu) ** 2).mean(-1, keepdim=True)
        return (z - mu) / torch.sqrt(var + 1e-5)

    def rope(vec, p):  # vec [..., N] at absolute position p
        i = torch.arange(N, dtype=torch.float64)
        freq = 1.0 / (2.0**16) ** (2 * torch.floor(i / 2) / N) / (2 * math.pi)
        phase = torch.frac(p * freq) * 2 * math.pi
        rot = torch.empty_like(vec)
        rot[..., 0::2] = -vec[..., 1::2]
        rot[..., 1::2] = vec[..., 0::2]
        return vec * torch.cos(phase) + rot * torch.sin(phase)

    rate = 2.0 ** (-torch.arange(H, dtype=torch.float64) / H)
    if position == "alibi_spread":  # ALiBi's slopes 2^(-8(h+1)/H): for H = 2, 1/16 and 1/256
        rate = torch.tensor([1 / 16, 1 / 256], dtype=torch.float64)
    if position == "alibi_slow":  # alibi's first head, the last one's rate 1/16
        rate = torch.tensor([1.0, 1 / 16], dtype=torch.float64)
    if position == "alibi_learned":  # each head's rate times exp(its learned gain)
        rate = rate * torch.exp(weights["decay_log_gain"].double())
    decay = torch.exp(-rate)
    B, T = idx.shape
    logits = torch.empty(B, T, head.shape[1], dtype=torch.float64)
    rho = [
        torch.zeros(B, H, N, D, dtype=torch.float64) if rho0 is None else rho0[l].clone()
        for l in range(n_layer)
    ]
    for t in range(T):
        u = ln(emb[idx[:, t]])  # [B, D]
        for l in range(n_layer):
            x = torch.relu(torch.einsum("bd,hdn->bhn", u, enc))
            q = rope(x, start + t) if position == "rope" else x
            out = torch.einsum("bhn,bhnd->bhd", q, rho[l])  # read before write
            rho[l] = rho[l] + torch.einsum("bhn,bd->bhnd", q, u)
            if position != "rope":
                rho[l] = rho[l] * decay.view(1, H, 1, 1)
            a = ln(out)
            y = x * torch.relu(torch.einsum("bhd,hdn->bhn", a, enc_v))
            m = ln(y.reshape(B, H * N) @ dec)
            u = ln(u + m)
        logits[:, t] = u @ head
    return logits, rho


@pytest.mark.parametrize(
    "position", ["rope", "alibi", "alibi_learned", "alibi_spread", "alibi_slow"]
)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_model_matches_spec_reference_fp64(position, executor):
    model = tiny_model(torch.float64, position=position, executor=executor, chunk_size=3)
    if position == "alibi_learned":
        with torch.no_grad():
            model.decay_log_gain.copy_(torch.tensor([0.7, -0.9]))
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 32, (2, 9))
    state = model.init_state(2)
    state.position += 1000  # absolute positions far from zero exercise rope's frac()
    logits = model.logits_from_hidden(model.forward_hidden(idx, state))
    ref_logits, ref_rho = spec_reference(weights, idx, 2, position, start=1000)
    assert (logits - ref_logits).abs().max().item() < 1e-10
    for got, ref in zip(state.rho, ref_rho, strict=True):
        assert (got - ref).abs().max().item() < 1e-10


def test_reference_continues_from_nonzero_state_fp64():
    model = tiny_model(torch.float64, position="alibi")
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    first, second = torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 4))
    state = model.init_state(1)
    model.forward_hidden(first, state)
    logits = model.logits_from_hidden(model.forward_hidden(second, state))
    _, rho_mid = spec_reference(weights, first, 2, "alibi")
    ref_logits, _ = spec_reference(weights, second, 2, "alibi", start=5, rho0=rho_mid)
    assert (logits - ref_logits).abs().max().item() < 1e-10


def test_alibi_spread_decays_at_alibis_slopes():
    """ALiBi's slopes 2^(-8(h+1)/H) for H = 4: 1/4, 1/16, 1/64, 1/256, exact in float64;
    burn_dragon's (alibi) stay 2^(-h/H), and rope has none."""
    spread = position_log_decay("alibi_spread", 4)
    assert spread is not None and spread.dtype == torch.float64
    assert torch.equal(spread, -torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256], dtype=torch.float64))
    official = position_log_decay("alibi", 4)
    assert official is not None
    assert torch.equal(official, -(2.0 ** -(torch.arange(4, dtype=torch.float64) / 4)))
    assert position_log_decay("rope", 4) is None


def test_alibi_slow_keeps_alibis_rates_but_the_last_heads():
    """For H = 4: alibi's 2^(-h/H) for h = 0, 1, 2, and 1/16 for the last head (1/e of a
    token's weight left after 16 tokens), exact in float64."""
    slow = position_log_decay("alibi_slow", 4)
    assert slow is not None and slow.dtype == torch.float64
    rates = [1.0, 2.0**-0.25, 2.0**-0.5, 1 / 16]
    assert torch.equal(slow, -torch.tensor(rates, dtype=torch.float64))
