"""BDHConfig validation: every invalid field is named."""

from __future__ import annotations

import pytest

from bdh_train.errors import ConfigError
from bdh_train.model import BDHConfig

CASES = [
    ({"n_layer": 0}, "model.n_layer must be a positive integer"),
    ({"n_embd": -4}, "model.n_embd must be a positive integer"),
    ({"n_head": 3}, "model.mlp_internal_dim_multiplier * model.n_embd must be divisible"),
    (
        {"n_embd": 6, "n_head": 4, "mlp_internal_dim_multiplier": 2},
        "model.n_embd must be divisible by model.n_head (4), got 6",
    ),
    ({"n_head": 0}, "model.n_head must be a positive integer"),
    ({"mlp_internal_dim_multiplier": 0}, "model.mlp_internal_dim_multiplier must be"),
    ({"n_embd": 6, "n_head": 6, "mlp_internal_dim_multiplier": 1}, None),
    ({"vocab_size": 2.5}, "model.vocab_size must be a positive integer"),
    ({"dropout": 1.0}, "model.dropout must be a number in [0, 1)"),
    ({"dropout": -0.1}, "model.dropout must be a number in [0, 1)"),
    ({"position": "learned"}, "model.position must be one of 'rope', 'alibi'"),
    ({"norm": "rms"}, "model.norm must be one of 'layernorm', 'layernorm_affine'"),
    ({"executor": "flash"}, "model.executor must be one of"),
    ({"chunk_size": -1}, "model.chunk_size must be a non-negative integer"),
    ({"n_layer": True}, "model.n_layer must be a positive integer"),
]


@pytest.mark.parametrize(("fields", "message"), CASES)
def test_invalid_fields_are_named(fields, message):
    if message is None:
        BDHConfig(**fields).validate()
        return
    with pytest.raises(ConfigError) as err:
        BDHConfig(**fields).validate()
    assert message in str(err.value)


def test_from_dict_rejects_unknown_key_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key model.n_layers \(did you mean 'n_layer'"):
        BDHConfig.from_dict({"n_layers": 2})


def test_from_dict_validates_values():
    with pytest.raises(ConfigError, match="model.position must be one of"):
        BDHConfig.from_dict({"position": "sinusoidal"})


def test_multiplier_times_embd_divisible_by_heads():
    with pytest.raises(ConfigError, match="mlp_internal_dim_multiplier \\* model.n_embd"):
        BDHConfig(n_embd=4, n_head=8, mlp_internal_dim_multiplier=1).validate()


def test_official_defaults():
    c = BDHConfig().validate()
    assert (
        c.n_layer,
        c.n_embd,
        c.n_head,
        c.mlp_internal_dim_multiplier,
        c.dropout,
        c.vocab_size,
        c.position,
        c.norm,
    ) == (6, 256, 4, 128, 0.1, 256, "rope", "layernorm")
    assert c.n_neurons == 8192
