"""Synthetic neural-cellular-automaton (NCA) token streams, generated on the fly.

Each sequence is one random automaton run: a grid of `grid_size`^2 cells with `state_count`
states evolves for `steps` updates under a random rule, and every frame (the initial grid and
each update) is written as patch tokens. Predicting the next frame means inferring the rule
in context, which is what NCA pre-training is for.

Rule: an outer-totalistic random lookup table next = table[state, counts] where counts is the
number of Moore neighbours (8, toroidal wrap) in each state. Instead of materialising the
table (it has S * C(8 + S - 1, S - 1) entries) it is evaluated as a seeded 64-bit hash of
(state, counts), so it costs nothing for any S. `rule_count` rules are drawn per seed and each
sequence uses one of them.

Tokens (matching the NCA factorized head): a p x p patch of cells is the base-S number
of its cells, row-major, cell 0 the most significant digit, so patch ids are 0..K-1 with
K = S**(p*p). Patches are read row-major over the grid. With frame_special_tokens each frame is
[K, patches..., K+1]; every sequence ends with EOS (default id: the first free id after the
frame tokens). Everything is a pure function of the seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from bdh_train import checks
from bdh_train.errors import ConfigError
from bdh_train.model.config import LanguageHeadConfig

DEFAULT_N_SEQUENCES = 1024
"""Sequences generated when neither n_sequences nor total_tokens is given."""
_CHUNK = 4096
"""Sequences simulated at once (bounds memory for large corpora)."""
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass
class NcaConfig:
    """Everything that determines an NCA corpus: the `[data.nca]` config section, also accepted
    by `nca_source` as a mapping or any object with these attributes."""

    grid_size: int = 8
    """Cells per side of the square grid."""
    state_count: int = 2
    """States a cell can take."""
    steps: int = 16
    """Automaton updates per sequence (frames = steps + 1)."""
    patch_size: int = 2
    """Cells per side of the square patch one token encodes."""
    seed: int = 0
    """Seed of the rules and the initial grids; the corpus is a pure function of it."""
    rule_count: int = 4
    """Random rules drawn; each sequence uses one of them."""
    n_sequences: int | None = None
    """Sequences to generate (default 1024 when total_tokens is unset too)."""
    total_tokens: int | None = None
    """Generate at least this many tokens (rounded up to whole sequences)."""
    frame_special_tokens: bool = True
    """Wrap each frame in a start and an end token."""
    eos_id: int | None = None
    """The end-of-sequence id; None picks the first id after the patches and frame tokens."""

    def validate(self, prefix: str = "data.nca") -> NcaConfig:
        checks.positive_int(f"{prefix}.grid_size", self.grid_size)
        checks.int_at_least(f"{prefix}.state_count", self.state_count, 2)
        if self.state_count > 255:
            raise ConfigError(f"{prefix}.state_count must be <= 255, got {self.state_count}")
        checks.positive_int(f"{prefix}.steps", self.steps)
        checks.positive_int(f"{prefix}.patch_size", self.patch_size)
        checks.nonneg_int(f"{prefix}.seed", self.seed)
        checks.positive_int(f"{prefix}.rule_count", self.rule_count)
        checks.boolean(f"{prefix}.frame_special_tokens", self.frame_special_tokens)
        if self.n_sequences is not None:
            checks.positive_int(f"{prefix}.n_sequences", self.n_sequences)
        if self.total_tokens is not None:
            checks.positive_int(f"{prefix}.total_tokens", self.total_tokens)
        if self.n_sequences is not None and self.total_tokens is not None:
            raise ConfigError(f"set either {prefix}.n_sequences or {prefix}.total_tokens, not both")
        if self.eos_id is not None:
            checks.nonneg_int(f"{prefix}.eos_id", self.eos_id)
        checks.multiple_of(
            f"{prefix}.grid_size",
            self.grid_size,
            self.patch_size,
            f"{prefix}.patch_size",
            zero_ok=False,
        )
        return self

    @classmethod
    def from_any(cls, options: Any) -> NcaConfig:
        """From a mapping or any object with these attributes; validated."""
        if isinstance(options, NcaConfig):
            return options.validate()
        names = [f.name for f in fields(cls)]
        if isinstance(options, Mapping):
            unknown = sorted(set(options) - set(names))
            if unknown:
                raise ConfigError(
                    f"unknown NCA option(s) {', '.join(map(repr, unknown))}; known: "
                    f"{', '.join(names)}"
                )
            return cls(**dict(options)).validate()
        return cls(**{n: getattr(options, n) for n in names if hasattr(options, n)}).validate()

    @property
    def sequence_count(self) -> int:
        """How many sequences `nca_source` generates for these options."""
        if self.total_tokens is None:
            return DEFAULT_N_SEQUENCES if self.n_sequences is None else self.n_sequences
        per_seq = tokens_per_sequence(
            self.grid_size, self.patch_size, self.steps, self.frame_special_tokens
        )
        return math.ceil(self.total_tokens / per_seq)


def nca_head_config(
    state_count: int,
    patch_size: int,
    frame_special_tokens: bool = True,
    eos_id: int | None = None,
) -> tuple[LanguageHeadConfig, int]:
    """(the NCA head config matching this data, the smallest vocab_size that holds its ids).

    eos_id None picks the first id after the patches and frame tokens (K+2, or K without
    frame tokens).
    """
    checks.int_at_least("data.nca.state_count", state_count, 2)
    checks.positive_int("data.nca.patch_size", patch_size)
    k = state_count ** (patch_size * patch_size)
    if eos_id is None:
        eos_id = k + 2 if frame_special_tokens else k
    head = LanguageHeadConfig(
        type="nca_factorized_patch",
        state_count=state_count,
        patch_size=patch_size,
        frame_special_tokens=frame_special_tokens,
        eos_id=eos_id,
    )
    vocab = max([k - 1, *head.special_tokens]) + 1
    head.validate(vocab, "data.nca")
    return head, vocab


def tokens_per_sequence(
    grid_size: int, patch_size: int, steps: int, frame_special_tokens: bool = True
) -> int:
    """(steps + 1) frames of (grid/patch)^2 patches (+2 frame tokens each), then one EOS."""
    per_frame = (grid_size // patch_size) ** 2 + (2 if frame_special_tokens else 0)
    return (steps + 1) * per_frame + 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: turns a linear code into well-spread pseudo-random bits."""
    z = z ^ (z >> np.uint64(30))
    z = z * _MIX1
    z = z ^ (z >> np.uint64(27))
    z = z * _MIX2
    return z ^ (z >> np.uint64(31))


def nca_step(grids: np.ndarray, keys: np.ndarray, state_count: int) -> np.ndarray:
    """One synchronous update of grids [n, G, G] under per-grid rule keys [n, S + 1]."""
    code = grids.astype(np.uint64) * keys[:, state_count, None, None]
    for s in range(state_count):
        is_s = (grids == s).astype(np.uint64)
        count = np.zeros_like(is_s)
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                if dy or dx:
                    count += np.roll(is_s, (dy, dx), axis=(1, 2))
        code += count * keys[:, s, None, None]
    return (_mix64(code) % np.uint64(state_count)).astype(np.uint8)


def patch_tokens(frames: np.ndarray, state_count: int, patch_size: int) -> np.ndarray:
    """Frames [..., G, G] -> patch ids [..., (G/p)^2], row-major, cell 0 most significant."""
    *lead, g, _ = frames.shape
    q = g // patch_size
    cells = frames.reshape(*lead, q, patch_size, q, patch_size)
    cells = np.moveaxis(cells, -3, -2).reshape(*lead, q * q, patch_size * patch_size)
    powers = state_count ** np.arange(patch_size * patch_size - 1, -1, -1, dtype=np.int64)
    return cells.astype(np.int64) @ powers


def generate_nca_tokens(
    grid_size: int,
    state_count: int,
    steps: int,
    patch_size: int,
    seed: int,
    n_sequences: int,
    frame_special_tokens: bool = True,
    eos_id: int | None = None,
    rule_count: int = 4,
) -> np.ndarray:
    """n_sequences NCA runs as one flat array of token ids (uint16, or uint32 if needed).

    Each sequence holds tokens_per_sequence(...) ids and ends with EOS; the array is a pure
    function of the arguments.
    """
    NcaConfig(
        grid_size,
        state_count,
        steps,
        patch_size,
        seed,
        rule_count,
        n_sequences,
        None,
        frame_special_tokens,
        eos_id,
    ).validate()
    head, vocab = nca_head_config(state_count, patch_size, frame_special_tokens, eos_id)
    k = head.patch_vocab
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, np.iinfo(np.uint64).max, (rule_count, state_count + 1), np.uint64)
    rule_of = rng.integers(0, rule_count, n_sequences)
    initial = rng.integers(0, state_count, (n_sequences, grid_size, grid_size), dtype=np.uint8)
    per_frame = (grid_size // patch_size) ** 2 + (2 if frame_special_tokens else 0)
    seq_len = tokens_per_sequence(grid_size, patch_size, steps, frame_special_tokens)
    out = np.empty((n_sequences, seq_len), dtype=dtype)
    for lo in range(0, n_sequences, _CHUNK):
        hi = min(lo + _CHUNK, n_sequences)
        grids, seq_keys = initial[lo:hi], keys[rule_of[lo:hi]]
        frames = [grids]
        for _ in range(steps):
            grids = nca_step(grids, seq_keys, state_count)
            frames.append(grids)
        ids = patch_tokens(np.stack(frames, axis=1), state_count, patch_size)  # [n, F, Q]
        body = np.empty((hi - lo, steps + 1, per_frame), dtype=dtype)
        if frame_special_tokens:
            body[:, :, 0], body[:, :, -1], body[:, :, 1:-1] = k, k + 1, ids
        else:
            body[:] = ids
        out[lo:hi, :-1] = body.reshape(hi - lo, -1)
        out[lo:hi, -1] = head.eos_id
    return out.reshape(-1)


def nca_source(options: Any, vocab_size: int | None = None) -> np.ndarray:
    """The `data.source = "nca"` generator: options (an NcaConfig, a mapping, or an object with
    grid_size, state_count, steps, patch_size, seed, optional rule_count, n_sequences or
    total_tokens, frame_special_tokens, eos_id) -> flat token ids.

    total_tokens rounds up to whole sequences. With vocab_size, the ids must fit in it.
    """
    o = NcaConfig.from_any(options)
    n = o.sequence_count
    if vocab_size is not None:
        head, need = nca_head_config(o.state_count, o.patch_size, o.frame_special_tokens, o.eos_id)
        if vocab_size < need:
            raise ConfigError(
                f"model.vocab_size must be >= {need} for NCA data with state_count "
                f"{o.state_count}, patch_size {o.patch_size} ({head.patch_vocab} patch ids + "
                f"special tokens {head.special_tokens}), got {vocab_size}"
            )
    return generate_nca_tokens(
        o.grid_size,
        o.state_count,
        o.steps,
        o.patch_size,
        o.seed,
        n,
        o.frame_special_tokens,
        o.eos_id,
        o.rule_count,
    )
