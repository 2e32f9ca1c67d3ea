"""Checkpoints of the official implementation (pathwaycom/bdh).

Its state_dict has exactly the keys below; parameter names coincide with ours, and
`attn.freqs` is a buffer we recompute. n_layer is not stored in the weights, so the caller
must give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from bdh_train.errors import CheckpointError
from bdh_train.model.bdh import BDH
from bdh_train.model.config import BDHConfig
from bdh_train.model.positions import rope_frequencies

OFFICIAL_KEYS = ("decoder", "encoder", "encoder_v", "embed.weight", "lm_head", "attn.freqs")


def infer_official_config(state_dict: Mapping[str, torch.Tensor], n_layer: int) -> BDHConfig:
    """BDHConfig (rope, parameter-free layernorm) from the shapes of an official state_dict."""
    missing = [k for k in OFFICIAL_KEYS if k not in state_dict]
    unexpected = [k for k in state_dict if k not in OFFICIAL_KEYS]
    if missing or unexpected:
        raise CheckpointError(
            "not an official BDH state_dict: "
            + "; ".join(
                part
                for part in (
                    f"missing keys {missing}" if missing else "",
                    f"unexpected keys {unexpected}" if unexpected else "",
                )
                if part
            )
        )
    encoder = state_dict["encoder"]
    if encoder.dim() != 3:
        raise CheckpointError(f"'encoder' must be [H, D, N], got {tuple(encoder.shape)}")
    n_head, n_embd, n_neurons = encoder.shape
    vocab_size = state_dict["embed.weight"].shape[0]
    multiplier = n_neurons * n_head / n_embd
    if multiplier != int(multiplier):
        raise CheckpointError(
            f"'encoder' shape {tuple(encoder.shape)} gives a non-integer "
            f"mlp_internal_dim_multiplier {multiplier}"
        )
    expected = {
        "decoder": (n_head * n_neurons, n_embd),
        "encoder": (n_head, n_embd, n_neurons),
        "encoder_v": (n_head, n_embd, n_neurons),
        "embed.weight": (vocab_size, n_embd),
        "lm_head": (n_embd, vocab_size),
        "attn.freqs": (1, 1, 1, n_neurons),
    }
    wrong = [
        f"{k}: expected {list(shape)}, got {list(state_dict[k].shape)}"
        for k, shape in expected.items()
        if tuple(state_dict[k].shape) != shape
    ]
    if wrong:
        raise CheckpointError("official BDH state_dict has mismatched shapes: " + "; ".join(wrong))
    return BDHConfig(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        mlp_internal_dim_multiplier=int(multiplier),
        vocab_size=vocab_size,
        position="rope",
        norm="layernorm",
    )


def load_official_state_dict(
    state_dict: Mapping[str, torch.Tensor], n_layer: int, dropout: float = 0.0
) -> BDH:
    """A BDH holding the official weights (config inferred from shapes)."""
    config = infer_official_config(state_dict, n_layer)
    config.dropout = dropout
    freqs = state_dict["attn.freqs"].reshape(-1).to(torch.float64)
    ours = rope_frequencies(config.n_neurons)
    if not torch.allclose(freqs, ours, rtol=1e-5, atol=0.0):
        raise CheckpointError(
            "official 'attn.freqs' differ from the rope frequencies this model computes "
            f"(theta=2^16, N={config.n_neurons}); max difference "
            f"{(freqs - ours).abs().max().item():.3g}"
        )
    model = BDH(config)
    weights = {k: v for k, v in state_dict.items() if k != "attn.freqs"}
    model.load_state_dict(weights, strict=True)
    return model


def load_official_checkpoint(path: str | Path, n_layer: int) -> BDH:
    """Load a `torch.save(model.state_dict())` file of the official implementation."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"official checkpoint {path} does not exist or is not a file")
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a corrupt file
        raise CheckpointError(f"cannot read official checkpoint {path}: {exc}") from exc
    if (
        isinstance(state_dict, Mapping)
        and "model" in state_dict
        and isinstance(state_dict["model"], Mapping)
    ):
        state_dict = state_dict["model"]
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{path} does not hold a state_dict")
    return load_official_state_dict(state_dict, n_layer)
