"""The tests' toolbox: tiny models and one closeness check.

Importable as `helpers` from every test (pyproject's pytest `pythonpath` puts tests/ on
sys.path).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from bdh_train.model import BDH, BDHConfig


# ------------------------------------------------------------------ tiny models
def tiny_config(**overrides) -> BDHConfig:
    """A model config small enough that every test is fast on two CPU cores."""
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


# ------------------------------------------------------------------ closeness
Tensors = torch.Tensor | Mapping[str, torch.Tensor]


def _flat(x: Tensors) -> torch.Tensor:
    if isinstance(x, Mapping):
        return torch.cat([t.detach().double().reshape(-1) for t in x.values()])
    return torch.as_tensor(x).detach().double().reshape(-1)


def assert_close(
    actual: Tensors, expected: Tensors, *, rtol: float, atol: float = 0.0, msg: str = ""
) -> None:
    """Norm-relative closeness: ||actual - expected|| <= atol + rtol * ||expected||.

    The 2-norm is taken in float64 over all elements. Per-element relative error is dominated
    by cancellation in tiny entries; the norm of the whole difference is not. `actual` and
    `expected` may be tensors (any shape, 0-d included) or dicts of tensors with the same keys,
    which are checked as one vector (all entries concatenated in `expected`'s key order).
    """
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{msg}: expected a dict of tensors"
        assert actual.keys() == expected.keys(), f"{msg}: keys {actual.keys()} != {expected.keys()}"
        actual = {name: actual[name] for name in expected}
    a, e = _flat(actual), _flat(expected)
    assert a.shape == e.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    diff = (a - e).norm().item()
    ref = e.norm().item()
    if diff <= atol + rtol * ref:
        return
    rel = diff / ref if ref > 0 else math.inf
    raise AssertionError(
        f"{msg}: norm-relative error {rel:.3e} (absolute {diff:.3e}) exceeds "
        f"rtol={rtol:g}, atol={atol:g}"
    )
