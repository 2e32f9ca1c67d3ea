"""The rope frequency table and model/surgery.py: merge and grow join or widen models along
N head by head, keep every neuron's frequency, and keep (grow) or compose (merge) the
function exactly as the algebra says. Models are float64, so "equal" is to 1e-10."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_close, tiny_config

from bdh_train.errors import ConfigError
from bdh_train.model import BDH
from bdh_train.model import bdh as bdh_module
from bdh_train.model.decoders import FastDecoder
from bdh_train.model.positions import rope_frequencies, rope_phase
from bdh_train.model.surgery import grow_weights, grown_config, merge_weights, merged_config


@functools.cache
def _trained(n_head: int, seed: int = 1) -> BDH:
    """A float64 tiny model after 12 sign-gradient steps on random tokens (weights away from
    their init, as Adam's first steps move them; no optimizer, whose first build imports
    torch._dynamo)."""
    torch.manual_seed(seed)
    model = BDH(tiny_config(n_head=n_head)).double()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(12):
        x = torch.randint(0, 32, (4, 17), generator=gen)
        _, loss = model(x[:, :-1], x[:, 1:])
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 3e-3 * param.grad.sign()
    return model.eval()


def _trained_weights(n_head: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _trained(n_head).state_dict().items()}


def _build(config, weights) -> BDH:
    model = BDH(config).double()
    model.load_state_dict(weights)
    return model.eval()


def _merge(states, configs, embeddings="average") -> BDH:
    names = [f"source {i}" for i in range(len(configs))]
    return _build(merged_config(configs, names), merge_weights(states, configs, embeddings))


def _grow(model: BDH, multiplier: int, seed: int = 5) -> BDH:
    config = grown_config(model.config, multiplier)
    torch.manual_seed(seed)
    fresh = BDH(config).double().state_dict()
    return _build(config, grow_weights(model.state_dict(), model.config, multiplier, fresh))


IDX = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------- the frequency table
def test_the_table_is_todays_frequencies_and_stays_float64_whatever_the_dtype():
    model = BDH(tiny_config())
    n = model.config.n_neurons
    assert model.rope_freqs.dtype == torch.float64
    assert torch.equal(model.rope_freqs, rope_frequencies(n))
    model.to(torch.bfloat16)
    model.half()
    assert model.encoder.dtype == torch.float16
    assert model.rope_freqs.dtype == torch.float64
    assert torch.equal(model.rope_freqs, rope_frequencies(n))
    assert "rope_freqs" in model.state_dict()
    assert "rope_freqs" not in BDH(tiny_config(position="alibi")).state_dict()


def test_the_forward_and_the_fast_decoder_read_the_models_table():
    """A model whose table is not rope_frequencies(N): its logits differ from the same
    weights with the default table, and the fast decoder's steps equal its full forward."""
    model = _trained(2)
    other = _build(model.config, {**model.state_dict(), "rope_freqs": model.rope_freqs.flip(0)})
    logits, _ = model(IDX[:1, :12])
    moved, _ = other(IDX[:1, :12])
    assert not torch.allclose(logits, moved)
    decoder = FastDecoder(other, other.init_state(1))
    steps = torch.stack([decoder.step(IDX[:1, t]) for t in range(12)], dim=1)
    assert_close(steps, other.forward_hidden(IDX[:1, :12]), rtol=1e-10)


# ---------------------------------------------------------------- merge
@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_merging_with_silent_neurons_keeps_the_logits(n_head):
    """B = A's weights with a zero decoder and a zero x-encoder (its neurons never fire, so
    they add nothing to the scores or the output; encoder_v random): A + B computes A."""
    a = _trained(n_head)
    b = _trained_weights(n_head)
    b["decoder"].zero_()
    b["encoder"].zero_()
    b["encoder_v"].normal_(std=0.02)
    merged = _merge([a.state_dict(), b], [a.config, a.config])
    assert_close(merged(IDX)[0], a(IDX)[0], rtol=1e-10)


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_merging_with_a_zero_decoder_copy_differs_only_by_the_norms_eps(n_head, monkeypatch):
    """B = A with a zero decoder: B's neurons are A's, so every head's attention scores
    double, which the norm after the attention undoes up to its eps. With the eps made
    negligible A + B computes A exactly; with the real eps 1e-5 it does not (see the
    docs: the difference measured here is printed)."""
    a = _trained(n_head)
    b = _trained_weights(n_head)
    b["decoder"].zero_()
    merged = _merge([a.state_dict(), b], [a.config, a.config])
    with_eps = (merged(IDX)[0] - a(IDX)[0]).norm() / a(IDX)[0].norm()
    print(f"H={n_head}: A + zero-decoder A vs A with eps 1e-5: {with_eps.item():.2e}")
    monkeypatch.setattr(bdh_module, "LN_EPS", 1e-30)
    assert_close(merged(IDX)[0], a(IDX)[0], rtol=1e-10)


def _decoder_calls(model: BDH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(y, y @ decoder) of every decoder projection the model runs from now on."""
    calls = []
    project = model._decode

    def recording(y):
        out = project(y)
        calls.append((y, out))
        return out

    model._decode = recording  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_merging_a_model_with_itself_doubles_each_heads_decoder_contribution(n_head, monkeypatch):
    """A + A under 'first': per head h the merged block is [A_h, A_h]; its neurons fire as
    A's do (the doubled scores are undone by the norm, eps made negligible), so per head
    the decoder contribution y_h @ decoder_h is exactly twice A's, in every layer."""
    monkeypatch.setattr(bdh_module, "LN_EPS", 1e-30)
    a = _trained(n_head)
    merged = _merge([a.state_dict(), a.state_dict()], [a.config, a.config], "first")
    n = a.config.n_neurons
    ours, theirs = _decoder_calls(merged), _decoder_calls(a)
    merged(IDX)
    a(IDX)
    assert len(ours) == len(theirs) == a.config.n_layer
    for (y2, out2), (y1, out1) in zip(ours, theirs, strict=True):
        for h in range(n_head):
            block = merged.decoder[h * 2 * n : (h + 1) * 2 * n]  # head h's rows, head-major
            own = a.decoder[h * n : (h + 1) * n]
            contribution = y2[:, h] @ block
            assert_close(contribution, 2 * (y1[:, h] @ own), rtol=1e-10, msg=f"head {h}")
        assert_close(y2[..., :n], y1, rtol=1e-10)
        assert_close(y2[..., n:], y1, rtol=1e-10)
        assert_close(out2, 2 * out1, rtol=1e-10)  # the whole projection: the sum over heads


def test_a_merge_keeps_each_sources_frequencies_and_averages_the_dense_parts():
    a, b = _trained(2, seed=1), _trained(2, seed=2)
    b_weights = {**b.state_dict(), "rope_freqs": b.rope_freqs * 0.5}  # a table of its own
    merged = _merge([a.state_dict(), b_weights], [a.config, b.config])
    n = a.config.n_neurons
    assert torch.equal(merged.rope_freqs, torch.cat([a.rope_freqs, b_weights["rope_freqs"]]))
    position = torch.tensor([[1000]])
    phase = rope_phase(position, merged.rope_freqs)
    assert torch.equal(phase[..., :n], rope_phase(position, a.rope_freqs))
    assert torch.equal(phase[..., n:], rope_phase(position, b_weights["rope_freqs"]))
    assert_close(merged.embed.weight, (a.embed.weight + b.embed.weight) / 2, rtol=1e-15)
    assert_close(merged.lm_head, (a.lm_head + b.lm_head) / 2, rtol=1e-15)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (dict(n_embd=32), "n_embd"),
        (dict(n_head=4), "n_head"),
        (dict(n_layer=3), "n_layer"),
        (dict(vocab_size=64), "vocab_size"),
        (dict(position="alibi"), "position"),
        (dict(token_shift=True), "token_shift"),
    ],
)
def test_a_merge_of_different_shapes_is_refused(change, key):
    with pytest.raises(ConfigError, match=rf"model\.{key} differs"):
        merged_config([tiny_config(), tiny_config(**change)], ["A", "B"])


def test_quantized_and_odd_neuron_models_are_refused():
    quant = tiny_config()
    quant.quant.enable = True
    with pytest.raises(ConfigError, match="quantization-aware"):
        merged_config([quant, quant], ["A", "B"])
    with pytest.raises(ConfigError, match="quantization-aware"):
        grown_config(quant, 2) and grow_weights({}, quant, 2, {})
    odd = tiny_config(n_embd=6, n_head=2, mlp_internal_dim_multiplier=1)  # N = 3
    with pytest.raises(ConfigError, match="odd number of neurons"):
        merged_config([odd, odd], ["A", "B"])


# ---------------------------------------------------------------- grow
@pytest.mark.parametrize(("n_head", "multiplier"), [(1, 2), (2, 3), (4, 8), (2, 8)])
def test_grow_keeps_the_logits_and_every_old_neurons_phase(n_head, multiplier):
    """The grown model's logits equal the trained model's to 1e-6 (the new neurons' small
    x-encoder columns add GROW_ENCODER_SCALE^2 of a fresh model's scores); per head the old
    neurons come first, unchanged, with their frequencies: their phases at position 1000
    are bit-identical; the new decoder rows are zero."""
    a = _trained(n_head)
    grown = _grow(a, multiplier)
    assert_close(grown(IDX)[0], a(IDX)[0], rtol=1e-6)
    n = a.config.n_neurons
    position = torch.tensor([[1000]])
    assert torch.equal(
        rope_phase(position, grown.rope_freqs)[..., :n], rope_phase(position, a.rope_freqs)
    )
    assert torch.equal(grown.rope_freqs, a.rope_freqs.repeat(multiplier))
    assert torch.equal(grown.encoder[..., :n], a.encoder)
    assert torch.equal(grown.encoder_v[..., :n], a.encoder_v)
    blocks = grown.decoder.view(n_head, multiplier * n, -1)
    assert torch.equal(blocks[:, :n], a.decoder.view(n_head, n, -1))
    assert not blocks[:, n:].any()
    assert grown.encoder[..., n:].abs().min() > 0  # relu passes gradient to every new neuron


def test_grow_of_a_grown_model_keeps_the_first_tables_frequencies():
    a = _trained(2)
    twice = _grow(_grow(a, 2), 2)
    assert torch.equal(twice.rope_freqs, a.rope_freqs.repeat(4))


def test_grow_refuses_a_multiplier_below_two():
    with pytest.raises(ConfigError, match="--neurons-multiplier must be an integer >= 2"):
        grown_config(tiny_config(), 1)
