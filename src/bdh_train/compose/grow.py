"""`bdh-train grow` (a run's neurons widened, the function kept: `model/surgery.py`) and
`bdh-train import-official` (a checkpoint of the official implementation), each written as a
checkpoint directory a new run starts from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bdh_train import checks
from bdh_train.compose.common import Source, check_out, load_source, write_composed
from bdh_train.errors import ConfigError
from bdh_train.model import BDH, BDHConfig
from bdh_train.model.bdh import parameter_bytes, physical_memory
from bdh_train.model.surgery import grow_weights, grown_config

# ---------------------------------------------------------------- grow
GROW_COPIES = 3
"""Copies of the grown model `grow_run` holds at its peak, besides the source: the fresh
model its new neurons come from, the grown weights, and their bytes while the checkpoint is
written (safetensors serializes each tensor)."""


def _check_grow_fits(source: BDHConfig, grown: BDHConfig, multiplier: int) -> None:
    """Refuse, before allocating, a grow whose peak (GROW_COPIES copies of the grown model
    and the source) exceeds this machine's memory."""
    memory = physical_memory()
    need = GROW_COPIES * parameter_bytes(grown) + parameter_bytes(source)
    if memory is not None and need > memory:
        raise ConfigError(
            f"--neurons-multiplier {multiplier} makes a model of "
            f"{grown.parameter_count():.3g} parameters, and grow holds {GROW_COPIES} copies "
            f"of it besides the source ({need / 2**30:.1f} GiB), more than this machine's "
            f"memory ({memory / 2**30:.1f} GiB); use a smaller --neurons-multiplier"
        )


def grow_run(source: str, multiplier: int, out: str | Path, seed: int = 0) -> Path:
    """Write `source`'s model widened to `multiplier` times its neurons per head
    (`grow_weights`: the same function, new neurons drawn from a fresh model seeded with
    `seed`) as the checkpoint directory `out`."""
    out = check_out(out)
    checks.seed("--seed", seed)
    src = load_source(source)
    config = grown_config(src.model.config, multiplier)
    _check_grow_fits(src.model.config, config, multiplier)
    torch.manual_seed(seed)
    grown = BDH(config).to(src.model.embed.weight.dtype)
    weights = grow_weights(src.model.state_dict(), src.model.config, multiplier, grown.state_dict())
    grown.load_state_dict(weights)
    return write_composed(out, grown, src, command="grow")


# ---------------------------------------------------------------- import-official
def import_official(path: str | Path, n_layer: int, out: str | Path) -> Path:
    """Write the official pathwaycom/bdh checkpoint `path` (a `torch.save` of its state_dict;
    `interop.load_official_checkpoint`, which needs `n_layer`: the weights do not hold it) as
    the checkpoint directory `out`, with the default run config (its model section the
    checkpoint's) and, for a 256-token vocabulary, the byte tokenizer the official code reads
    text with."""
    from bdh_train.config import load_config
    from bdh_train.model.official import load_official_checkpoint
    from bdh_train.shared.loading import tokenizer_for

    out = check_out(out)
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
        raise ConfigError(f"--n-layer must be an integer >= 1, got {n_layer!r}")
    model = load_official_checkpoint(path, n_layer)
    cfg = dataclasses.replace(load_config(), model=model.config)
    source = Source(str(path), model, tokenizer_for(model.config), cfg)
    return write_composed(out, model, source, command="import-official")
