"""Multi-query associative recall (MQAR): the synthetic recall task of Zoology (Arora et al.,
2023, "Zoology: Measuring and Improving Recall in Efficient Language Models"), generated.

An example of `length` tokens over a vocabulary of V ids holds P key-value pairs and then
one query of each key:

    k1 v1 k2 v2 ... kP vP | filler with each key once, at an even offset, its value after it

Keys are P distinct ids from [1, V/2), values P distinct ids from [V/2, V) (V/2 rounded
down), both drawn afresh for every example. The query region after the 2P pair tokens has
S = (length - 2P) // 2 even offsets 0, 2, ..., 2(S - 1); the P queries take P distinct
offsets drawn without replacement with weights w(g) = a * (g + 1)^(a - 1) (Zoology's power
law; `power_a` = a, 0.01 by default, puts most queries soon after the pairs, 1 is uniform),
key i at the i-th offset drawn. Every other token of the query region is filler: uniform
over [0, V) (`random_fill`, Zoology's `random_non_queries`) or 0.

The target of a query key's position is its value, and only those positions are scored
(`targets` holds IGNORE_INDEX everywhere else), as in Zoology. One difference from Zoology's
inputs: the token after each query key is its value, where Zoology leaves filler, so that
the examples are also an ordinary token stream whose next-token targets include the answers
(`mqar_source`, `data.source = "mqar"`). A value is read only after it was to be predicted,
and each key is queried once, so no answer is shown before its query.

Everything is a pure function of the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bdh_train import checks
from bdh_train.batch import IGNORE_INDEX
from bdh_train.data.tokens import TokenData
from bdh_train.errors import ConfigError

MAX_TOKENS = 1 << 31
"""The most tokens (examples x length) one generated corpus may hold: the int64 arrays of
its generation take 8 bytes per token each."""
_NOISE_BUDGET = 1 << 22
"""Uniform draws alive at once when keys and values are drawn (32 MiB of float64)."""


@dataclass
class MqarConfig:
    """The generated MQAR corpus: the `[data.mqar]` config section (data.source = "mqar")."""

    pairs: int = 16
    """Key-value pairs per example (each key is queried once); the most, with min_pairs."""
    min_pairs: int = 0
    """With 1 or more: each example's number of pairs is drawn uniformly from [min_pairs,
    pairs], so the corpus mixes counts as Zoology's training sets do (a model trained on one
    count can learn that count's layout instead of recall); 0: every example holds `pairs`."""
    length: int = 128
    """Tokens per example: the 2 x pairs of the pairs, then the query region; at least 4 x
    pairs (the query region needs an even offset per query)."""
    vocab_size: int | None = None
    """Ids the examples use: keys from [1, vocab_size/2), values from [vocab_size/2,
    vocab_size); None is the model's vocab_size."""
    power_a: float = 0.01
    """The power law of the queries' offsets, weight a * (g + 1)^(a - 1) for offset 2g: small
    values put most queries soon after the pairs, 1 is uniform."""
    random_fill: bool = True
    """Filler between the queries uniform over the vocabulary (else 0)."""
    seed: int = 0
    """Seed of the examples; the corpus is a pure function of it."""
    examples: int = 4096
    """Examples generated; each is a document of `length` tokens."""

    def validate(self, prefix: str = "data.mqar") -> MqarConfig:
        checks.positive_int(f"{prefix}.pairs", self.pairs)
        checks.nonneg_int(f"{prefix}.min_pairs", self.min_pairs)
        if self.min_pairs > self.pairs:
            raise ConfigError(
                f"{prefix}.min_pairs ({self.min_pairs}) must be at most {prefix}.pairs "
                f"({self.pairs}): lower it, or 0 for {self.pairs} pairs in every example"
            )
        checks.positive_int(f"{prefix}.length", self.length)
        if self.vocab_size is not None:
            checks.positive_int(f"{prefix}.vocab_size", self.vocab_size)
        checks.number(
            f"{prefix}.power_a", self.power_a, low=0.0, high=1.0, low_open=True, high_open=False
        )
        checks.boolean(f"{prefix}.random_fill", self.random_fill)
        checks.nonneg_int(f"{prefix}.seed", self.seed)
        checks.positive_int(f"{prefix}.examples", self.examples)
        check_shape(self.pairs, self.length, self.vocab_size, f"{prefix}.pairs", prefix)
        if self.examples * self.length > MAX_TOKENS:
            raise ConfigError(
                f"{prefix}.examples x {prefix}.length is {self.examples * self.length:,} "
                f"tokens, more than {MAX_TOKENS:,}: generate fewer or shorter examples"
            )
        return self


def check_shape(
    pairs: int, length: int, vocab_size: int | None, pairs_name: str, where: str
) -> None:
    """ConfigError unless `pairs` pairs and their queries fit in `length` tokens (4 x pairs)
    and `vocab_size` (when known) has `pairs` distinct keys and values."""
    if 4 * pairs > length:
        raise ConfigError(
            f"{where}: {pairs} pairs need at least {4 * pairs} tokens per example (the pairs, "
            f"then an even offset per query), got length {length}: lower {pairs_name} or "
            "lengthen the examples"
        )
    if vocab_size is not None and min(vocab_size // 2 - 1, vocab_size - vocab_size // 2) < pairs:
        raise ConfigError(
            f"{where}: {pairs} pairs need {2 * pairs + 2} ids or more (distinct keys from "
            f"[1, V/2), values from [V/2, V)), got a vocabulary of {vocab_size}"
        )


def gap_weights(space: int, power_a: float) -> np.ndarray:
    """The probabilities [space] of the query offsets 0, 2, ..., 2(space - 1): proportional
    to a * (g + 1)^(a - 1), float64."""
    w = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return w / w.sum()


def mqar_layout(
    keys: np.ndarray, values: np.ndarray, gaps: np.ndarray, length: int, fill: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets), int64 [n, length], of examples with these keys and values [n, P]
    queried at these offsets [n, P] (key i at offset 2 * gaps[:, i] of the query region),
    the other tokens of the query region taken from `fill` [n, length]."""
    n, pairs = keys.shape
    context = 2 * pairs
    tokens = np.array(fill, dtype=np.int64, copy=True)
    tokens[:, 0:context:2] = keys
    tokens[:, 1:context:2] = values
    rows = np.arange(n)[:, None]
    at = context + 2 * np.asarray(gaps, dtype=np.int64)
    tokens[rows, at] = keys
    tokens[rows, at + 1] = values
    targets = np.full((n, length), IGNORE_INDEX, dtype=np.int64)
    targets[rows, at] = values
    return tokens, targets


def _distinct(rng: np.random.Generator, n: int, low: int, high: int, size: int) -> np.ndarray:
    """[n, size] int64: each row `size` distinct ids from [low, high), in random order (the
    first `size` of a uniform random permutation: the ranks of uniform noise)."""
    rows = max(1, _NOISE_BUDGET // (high - low))
    parts = [
        np.argsort(rng.random((min(rows, n - lo), high - low)), axis=1)[:, :size]
        for lo in range(0, n, rows)
    ]
    return np.concatenate(parts).astype(np.int64) + low


def mqar_examples(
    pairs: int,
    length: int,
    vocab_size: int,
    count: int,
    seed: int | Sequence[int],
    power_a: float = 0.01,
    random_fill: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets), int64 [count, length]: `count` examples (module docstring), a pure
    function of the arguments; `targets` is IGNORE_INDEX except at each query key, where it
    is the key's value."""
    check_shape(pairs, length, vocab_size, "the pairs", "MQAR")
    rng = np.random.default_rng(seed)
    half = vocab_size // 2
    keys = _distinct(rng, count, 1, half, pairs)
    values = _distinct(rng, count, half, vocab_size, pairs)
    space = (length - 2 * pairs) // 2
    # P draws without replacement with weights w: the P largest of log w + Gumbel noise, in
    # decreasing order, are distributed as P successive draws (the Gumbel-top-k trick).
    scores = np.log(gap_weights(space, power_a)) + rng.gumbel(size=(count, space))
    gaps = np.argsort(-scores, axis=1, kind="stable")[:, :pairs]
    if random_fill:
        fill = rng.integers(0, vocab_size, (count, length), dtype=np.int64)
    else:
        fill = np.zeros((count, length), dtype=np.int64)
    return mqar_layout(keys, values, gaps, length, fill)


def mqar_source(options: MqarConfig, vocab_size: int) -> TokenData:
    """The `data.source = "mqar"` generator: options.examples examples as one token stream,
    each a document (its start in `doc_starts`), ids below options.vocab_size (default
    `vocab_size`, the model's)."""
    o = options.validate()
    vocab = vocab_size if o.vocab_size is None else o.vocab_size
    if vocab > vocab_size:
        raise ConfigError(
            f"data.mqar.vocab_size ({vocab}) must be at most model.vocab_size ({vocab_size})"
        )
    check_shape(o.pairs, o.length, vocab, "data.mqar.pairs", "data.mqar")
    tokens, _, _ = mqar_corpus(o, vocab)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    return TokenData(
        tokens.astype(dtype).reshape(-1),
        vocab_size,
        f"generator 'mqar' ({o.examples:,} examples of {o.length} tokens, {o.pairs} pairs)",
        doc_starts=np.arange(o.examples, dtype=np.uint64) * np.uint64(o.length),
    )


def mqar_corpus(options: MqarConfig, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, targets) [examples, length] and each example's number of pairs [examples] of
    the corpus `options` describe over `vocab_size` ids. Without min_pairs, `mqar_examples`
    with the options' seed; with it, each example's count drawn with seed [seed, 0], and the
    examples of count p generated by `mqar_examples` with seed [seed, p], in their places."""
    o = options
    if not o.min_pairs:
        tokens, targets = mqar_examples(
            o.pairs, o.length, vocab_size, o.examples, o.seed, o.power_a, o.random_fill
        )
        return tokens, targets, np.full(o.examples, o.pairs, dtype=np.int64)
    counts = np.random.default_rng([o.seed, 0]).integers(o.min_pairs, o.pairs + 1, o.examples)
    tokens = np.empty((o.examples, o.length), dtype=np.int64)
    targets = np.empty_like(tokens)
    for p in np.unique(counts).tolist():
        rows = np.flatnonzero(counts == p)
        tokens[rows], targets[rows] = mqar_examples(
            p, o.length, vocab_size, len(rows), [o.seed, p], o.power_a, o.random_fill
        )
    return tokens, targets, counts


def chance_accuracy(vocab_size: int) -> float:
    """The accuracy of a guess uniform over the value ids [V/2, V): 1 / (V - V/2)."""
    return 1.0 / (vocab_size - vocab_size // 2)
