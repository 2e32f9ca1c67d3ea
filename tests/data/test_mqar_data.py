"""The MQAR generator (`bdh_train.data.mqar`) on cases written by hand: Zoology's own example
laid out token by token, the format of generated examples, the power law of the queries'
offsets, determinism, the `data.source = "mqar"` stream and its config's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from bdh_train.batch import IGNORE_INDEX
from bdh_train.config import load_config
from bdh_train.data.mqar import (
    MqarConfig,
    gap_weights,
    mqar_corpus,
    mqar_examples,
    mqar_layout,
    mqar_source,
)
from bdh_train.errors import ConfigError

X = IGNORE_INDEX


def test_layout_of_zoologys_example():
    # Zoology's docstring: vocab 12, pairs (2, 8) and (4, 7), 16 tokens; key 4 queried at
    # offset 2 of the query region (token 6), key 2 at offset 8 (token 12); its value after it
    tokens, targets = mqar_layout(
        np.array([[2, 4]]), np.array([[8, 7]]), np.array([[4, 1]]), 16, np.zeros((1, 16))
    )
    assert tokens.tolist() == [[2, 8, 4, 7, 0, 0, 4, 7, 0, 0, 0, 0, 2, 8, 0, 0]]
    assert targets.tolist() == [[X, X, X, X, X, X, 7, X, X, X, X, X, 8, X, X, X]]


def test_examples_format():
    pairs, length, vocab = 3, 20, 16
    tokens, targets = mqar_examples(pairs, length, vocab, 200, seed=7, random_fill=False)
    assert tokens.shape == targets.shape == (200, length)
    for row, target in zip(tokens, targets, strict=True):
        keys, values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(1 <= k < vocab // 2 for k in keys)
        assert len(set(values)) == pairs and all(vocab // 2 <= v < vocab for v in values)
        asked = np.flatnonzero(target != X)
        assert len(asked) == pairs and all((asked - 2 * pairs) % 2 == 0)
        assert sorted(row[asked]) == sorted(keys)  # each key queried once
        answer = dict(zip(keys, values, strict=True))
        assert [target[i] for i in asked] == [answer[row[i]] for i in asked]
        assert [row[i + 1] for i in asked] == [answer[row[i]] for i in asked]
        rest = np.ones(length, dtype=bool)
        rest[: 2 * pairs] = rest[asked] = rest[asked + 1] = False
        assert not row[rest].any()  # filler 0 without random_fill
    filled, _ = mqar_examples(pairs, length, vocab, 200, seed=7)
    assert filled.min() >= 0 and filled.max() < vocab and len(np.unique(filled[:, 6:])) > 8


def test_examples_are_a_pure_function_of_the_seed():
    first = mqar_examples(4, 32, 64, 10, seed=3)
    again = mqar_examples(4, 32, 64, 10, seed=3)
    other = mqar_examples(4, 32, 64, 10, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[0], other[0])


def test_gap_weights_by_hand_and_the_first_query_follows_them():
    assert gap_weights(3, 1.0) == pytest.approx([1 / 3] * 3, abs=1e-12)
    total = 1 + 2**-0.5 + 3**-0.5  # a (g + 1)^(a - 1) for a = 0.5, g = 0, 1, 2
    expected = [1 / total, 2**-0.5 / total, 3**-0.5 / total]
    assert gap_weights(3, 0.5) == pytest.approx(expected, abs=1e-12)
    # one pair: its query's offset is one draw from the weights (4 offsets, 20,000 draws:
    # the standard error of each frequency is below 0.0036)
    _, targets = mqar_examples(1, 10, 8, 20_000, seed=0, power_a=0.1)
    offsets = (np.argmax(targets != X, axis=1) - 2) // 2
    counts = np.bincount(offsets, minlength=4) / len(offsets)
    assert counts == pytest.approx(gap_weights(4, 0.1), abs=0.01)


def test_the_mqar_source_is_the_examples_as_documents():
    options = MqarConfig(pairs=2, length=12, vocab_size=20, seed=5, examples=6)
    data = mqar_source(options, 32)
    tokens, _ = mqar_examples(2, 12, 20, 6, 5)
    assert data.tokens.tolist() == tokens.reshape(-1).tolist()
    assert data.doc_starts.tolist() == [0, 12, 24, 36, 48, 60] and data.vocab_size == 32
    with pytest.raises(ConfigError, match=r"at most model.vocab_size \(16\)"):
        mqar_source(options, 16)


def test_min_pairs_mixes_counts_and_each_example_is_its_counts_own():
    """With min_pairs, every example holds its drawn count of pairs, checked by an oracle
    (its scored targets are that count, each the value after its key in the pairs region),
    every count of [min_pairs, pairs] appears, and the examples of count p are exactly
    `mqar_examples(p, ..., seed=[seed, p])` in their places."""
    options = MqarConfig(pairs=5, min_pairs=2, length=24, vocab_size=32, seed=3, examples=400)
    tokens, targets, counts = mqar_corpus(options.validate(), 32)
    assert tokens.shape == targets.shape == (400, 24)
    assert sorted(set(counts.tolist())) == [2, 3, 4, 5]
    assert min(np.bincount(counts)[2:]) > 60  # uniform: about 100 each
    for row, target, p in zip(tokens, targets, counts, strict=True):
        asked = np.flatnonzero(target != X)
        answer = dict(zip(row[0 : 2 * p : 2], row[1 : 2 * p : 2], strict=True))
        assert len(asked) == p and len(answer) == p
        assert [target[i] for i in asked] == [answer[row[i]] for i in asked]
    for p in (2, 5):
        rows = np.flatnonzero(counts == p)
        alone, _ = mqar_examples(p, 24, 32, len(rows), [3, p])
        assert np.array_equal(tokens[rows], alone)
    without = MqarConfig(pairs=5, length=24, vocab_size=32, seed=3, examples=400).validate()
    plain, _, fixed = mqar_corpus(without, 32)
    assert np.array_equal(plain, mqar_examples(5, 24, 32, 400, 3)[0]) and set(fixed) == {5}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.mqar.min_pairs=4", r"data.mqar.min_pairs \(4\) must be at most data.mqar.pairs"),
        ("data.mqar.pairs=9", "9 pairs need at least 36 tokens per example"),
        ("data.mqar.vocab_size=7", "3 pairs need 8 ids or more"),
        ("data.mqar.power_a=0", "data.mqar.power_a must be"),
        ("data.mqar.examples=100000000", "more than 2,147,483,648"),
    ],
)
def test_config_refusals(override, message):
    base = ["data.mqar.pairs=3", "data.mqar.length=32"]
    with pytest.raises(ConfigError, match=message):
        load_config(preset="tiny", overrides=[*base, override])


def test_train_reads_the_mqar_source():
    cfg = load_config(
        preset="tiny",
        overrides=[
            "data.source='mqar'",
            "data.mqar.pairs=4",
            "data.mqar.length=32",
            "data.mqar.examples=20",
        ],
    )
    train, val = cfg.data.load_splits(cfg.model.vocab_size, 31)
    assert len(train) + len(val) == 20 * 32 and train.doc_starts.tolist()[:2] == [0, 32]
