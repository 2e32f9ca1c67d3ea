"""Joining and widening BDH models along the neuron dimension N: the tensor operations of
`bdh-train merge` and `bdh-train grow`.

Every head h owns its neurons: columns of encoder[h] and encoder_v[h] ([H, D, N]) and the
decoder rows h*N .. h*N + N - 1 ([H*N, D], head-major). Joining or widening therefore works
head by head: a source's block of head h becomes part of head h's block, never of another
head's (concatenating whole decoders along rows would move rows between heads as soon as
H > 1).

Under rope a neuron's rotation frequency belongs to it (the model's `rope_freqs` table), so
it travels with the neuron: a merge keeps each source's table, a grow keeps the old table and
appends one for the new neurons. Recomputing the table from the new N would change every old
neuron's phases.

The neurons of one head are not independent: they share the head's attention, whose scores
are q_t . q_s summed over all the head's neurons (keys are the queries). A merged head's
scores are the sum of its sources' scores, and a neuron added by grow adds to the scores as
soon as it fires. `grow_weights` keeps the function by giving the new neurons zero decoder
rows and small x-encoder columns (`GROW_ENCODER_SCALE`: their score terms are its square);
a merge changes the function wherever the sources' scores differ in more than a
scale (a layer norm follows the attention).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from bdh_train.errors import ConfigError
from bdh_train.model.bdh import ROPE_FREQS
from bdh_train.model.config import BDHConfig
from bdh_train.model.positions import rope_frequencies

NEURON_PARAMETERS = ("encoder", "encoder_v", "decoder")
"""The parameters with a neuron dimension; every other tensor is dense (the same shape in
every source)."""
EMBEDDING_CHOICES = ("average", "first")
"""How a merge takes the dense tensors: their mean over the sources, or the first source's."""
GROW_ENCODER_SCALE = 1e-3
"""Grow gives its new neurons a fresh model's x-encoder columns times this / sqrt(M - 1):
their terms in the attention scores add up to (M - 1) times the factor squared, 1e-6 of a
fresh model's for every multiplier M (measured on trained tiny models: logits moved by
7e-8 to 3e-7 of their norm), and they are not zero, so relu passes them gradient (a zero
column never fires and never learns)."""

_SAME = (
    "n_layer",
    "n_embd",
    "n_head",
    "vocab_size",
    "position",
    "token_shift",
    "norm",
    "language_head",
    "summary_memory",
)
"""The config fields every merged source must share (the dense shapes and the function)."""


def neuron_blocks(state: Mapping[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """The neuron parameters as per-head blocks [H, N, D] (decoder) or [H, D, N] (encoders)."""
    decoder = state["decoder"]
    return {
        "encoder": state["encoder"],
        "encoder_v": state["encoder_v"],
        "decoder": decoder.reshape(n_head, decoder.shape[0] // n_head, decoder.shape[1]),
    }


def rope_table(state: Mapping[str, torch.Tensor], config: BDHConfig) -> torch.Tensor:
    """A rope model's frequency table from its weights (`rope_frequencies(N)` for weights
    written before models kept one)."""
    table = state.get(ROPE_FREQS)
    if table is None:
        return rope_frequencies(config.n_neurons)
    return table.to(torch.float64)


def check_composable(config: BDHConfig, what: str) -> None:
    """Refuse a model that merge or grow cannot join along N with its function kept."""
    if config.quant.enable:
        raise ConfigError(
            f"{what} is quantization-aware (model.quant.enable = true): its ternary weights "
            "are scaled by the mean |W| of the whole tensor, so new neurons would change the "
            "old ones' quantized values; compose the float model it was trained from"
        )
    if config.position == "rope" and config.n_neurons % 2:
        raise ConfigError(
            f"{what} has an odd number of neurons per head ({config.n_neurons}): rope rotates "
            "neurons in pairs (2k, 2k+1), which joining would split"
        )


def merged_config(configs: Sequence[BDHConfig], names: Sequence[str]) -> BDHConfig:
    """The config of the sources joined along N: the first's, with the multipliers summed.
    Refused (ConfigError naming the field and the sources) when the sources differ in a
    field that decides the dense shapes or the function."""
    first = configs[0]
    for config, name in zip(configs, names, strict=True):
        check_composable(config, name)
        for key in _SAME:
            if getattr(config, key) != getattr(first, key):
                raise ConfigError(
                    f"cannot merge {name} with {names[0]}: model.{key} differs "
                    f"({getattr(config, key)!r} vs {getattr(first, key)!r}); merge only "
                    "models of the same width, heads, layers, vocabulary and scheme"
                )
    multiplier = sum(c.mlp_internal_dim_multiplier for c in configs)
    return dataclasses.replace(first, mlp_internal_dim_multiplier=multiplier).validate()


def merge_weights(
    states: Sequence[Mapping[str, torch.Tensor]],
    configs: Sequence[BDHConfig],
    embeddings: str = "average",
) -> dict[str, torch.Tensor]:
    """The sources' weights joined along N, head by head: per head h, the merged block is
    source 0's block of head h, then source 1's, ... (encoders concatenated along their last
    dimension, decoder rows in the same order, head-major). The rope table is the sources'
    tables side by side. Every dense tensor is the sources' mean ('average', taken in
    float64) or the first source's ('first')."""
    if embeddings not in EMBEDDING_CHOICES:
        raise ConfigError(f"--embeddings must be one of {EMBEDDING_CHOICES}, got {embeddings!r}")
    n_head = configs[0].n_head
    blocks = [neuron_blocks(state, n_head) for state in states]
    merged: dict[str, torch.Tensor] = {}
    for name, dim in (("encoder", 2), ("encoder_v", 2), ("decoder", 1)):
        joined = torch.cat([b[name] for b in blocks], dim=dim)
        merged[name] = joined.reshape(-1, joined.shape[-1]) if name == "decoder" else joined
    if configs[0].position == "rope":
        merged[ROPE_FREQS] = torch.cat(
            [rope_table(s, c) for s, c in zip(states, configs, strict=True)]
        )
    for name in states[0]:
        if name in NEURON_PARAMETERS or name == ROPE_FREQS:
            continue
        if embeddings == "first":
            merged[name] = states[0][name].clone()
        else:
            stacked = torch.stack([s[name].to(torch.float64) for s in states])
            merged[name] = stacked.mean(dim=0).to(states[0][name].dtype)
    return merged


def grown_config(config: BDHConfig, multiplier: int) -> BDHConfig:
    """`config` with `multiplier` times the neurons per head."""
    if isinstance(multiplier, bool) or not isinstance(multiplier, int) or multiplier < 2:
        raise ConfigError(f"--neurons-multiplier must be an integer >= 2, got {multiplier!r}")
    grown = config.mlp_internal_dim_multiplier * multiplier
    return dataclasses.replace(config, mlp_internal_dim_multiplier=grown).validate()


def grow_weights(
    state: Mapping[str, torch.Tensor],
    config: BDHConfig,
    multiplier: int,
    fresh: Mapping[str, torch.Tensor],
    encoder_scale: float | None = None,
) -> dict[str, torch.Tensor]:
    """The weights of `config` widened to `multiplier` times its neurons per head. Per head
    the old neurons come first, unchanged; the new ones take, from `fresh` (the weights of a
    freshly initialised model of the grown config), their encoder_v columns as they are and
    their x-encoder columns times `encoder_scale` (default GROW_ENCODER_SCALE / sqrt(M - 1));
    their decoder rows are zero, so they add
    nothing to the layer's output. Under rope the old table is repeated `multiplier` times:
    the old neurons keep their frequencies and every block of N new neurons spans the same
    frequencies a fresh model of N neurons has. Dense tensors are copied."""
    check_composable(config, "the model")
    n, h = config.n_neurons, config.n_head
    old = neuron_blocks(state, h)
    new = neuron_blocks(fresh, h)
    if new["encoder"].shape[-1] != n * multiplier:
        raise ValueError("`fresh` is not a model of the grown config")
    if encoder_scale is None:
        encoder_scale = GROW_ENCODER_SCALE / math.sqrt(multiplier - 1)
    grown = {name: tensor.clone() for name, tensor in state.items()}
    for name, scale in (("encoder", encoder_scale), ("encoder_v", 1.0)):
        added = new[name][..., n:].to(old[name].dtype) * scale
        grown[name] = torch.cat([old[name], added], dim=2)
    decoder = old["decoder"]
    zeros = decoder.new_zeros(h, n * (multiplier - 1), decoder.shape[-1])
    grown["decoder"] = torch.cat([decoder, zeros], dim=1).reshape(-1, decoder.shape[-1])
    if config.position == "rope":
        grown[ROPE_FREQS] = rope_table(state, config).repeat(multiplier)
    return grown
