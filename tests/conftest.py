"""Shared fixtures: small models that make every test fast on two CPU cores."""

from __future__ import annotations

import pytest
import torch

from bdh_train.model import BDH, BDHConfig


def tiny_config(**overrides) -> BDHConfig:
    base = dict(
        n_layer=2,
        n_embd=16,
        n_head=2,
        mlp_internal_dim_multiplier=4,
        vocab_size=32,
        dropout=0.0,
        chunk_size=4,
    )
    base.update(overrides)
    return BDHConfig(**base)


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> BDH:
    torch.manual_seed(seed)
    return BDH(tiny_config(**overrides)).to(dtype)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(2)
    yield
