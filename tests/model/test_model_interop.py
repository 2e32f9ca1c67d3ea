"""Loading official pathwaycom/bdh state_dicts."""

from __future__ import annotations

import pytest
import torch
from helpers import official_frequencies_buffer
from test_model_reference import spec_reference

from bdh_train.errors import CheckpointError
from bdh_train.interop import (
    load_official_checkpoint,
    load_official_state_dict,
)


def official_state_dict(H=2, D=16, N=32, V=40):
    g = torch.Generator().manual_seed(3)
    return {
        "decoder": torch.randn(H * N, D, generator=g) * 0.02,
        "encoder": torch.randn(H, D, N, generator=g) * 0.02,
        "encoder_v": torch.randn(H, D, N, generator=g) * 0.02,
        "embed.weight": torch.randn(V, D, generator=g) * 0.02,
        "lm_head": torch.randn(D, V, generator=g) * 0.02,
        "attn.freqs": official_frequencies_buffer(N),
    }


def test_official_weights_give_the_spec_reference_logits():
    sd = official_state_dict()
    model = load_official_state_dict(sd, n_layer=3).double().eval()
    c = model.config
    assert (c.n_head, c.n_embd, c.n_neurons, c.vocab_size, c.mlp_internal_dim_multiplier) == (
        2,
        16,
        32,
        40,
        4,
    )
    assert (c.position, c.norm) == ("rope", "layernorm")
    idx = torch.randint(0, 40, (2, 7))
    logits, _ = model(idx)
    weights = {k: v.double() for k, v in sd.items()}
    ref, _ = spec_reference(weights, idx, 3, "rope")
    assert (logits - ref).abs().max().item() < 1e-10


def test_checkpoint_file_round_trip(tmp_path):
    path = tmp_path / "official.pt"
    torch.save(official_state_dict(), path)
    model = load_official_checkpoint(path, n_layer=2)
    assert torch.equal(model.encoder, official_state_dict()["encoder"])


def test_wrong_shape_names_the_key():
    sd = official_state_dict()
    sd["lm_head"] = torch.zeros(16, 41)
    with pytest.raises(CheckpointError, match=r"lm_head: expected \[16, 40\], got \[16, 41\]"):
        load_official_state_dict(sd, n_layer=2)


def test_missing_and_unexpected_keys_are_listed():
    sd = official_state_dict()
    del sd["encoder_v"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(
        CheckpointError,
        match=r"missing keys \['encoder_v'\].*unexpected keys "
        r"\['extra'\]",
    ):
        load_official_state_dict(sd, n_layer=2)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_official_checkpoint(tmp_path / "nope.pt", n_layer=2)
