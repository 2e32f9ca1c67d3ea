"""Recall (`bdh_train.evals.recall`) scored on MQAR examples whose answers are known: an
oracle that reads the pairs answers everything, a scorer that remembers only the last pair
answers 1 / pairs of the queries, a constant guess what the hand count says; a BDH's scorer
gives one model call's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model

from bdh_train.batch import IGNORE_INDEX
from bdh_train.data.mqar import mqar_examples, mqar_layout
from bdh_train.errors import ConfigError
from bdh_train.evals import recall, scoring


def _oracle(remembers: int | None = None):
    """A scorer that answers each query key with the value that followed it in the pairs
    (the pairs are the tokens before the first answer: every token before it alternates key,
    value); with `remembers`, only the last `remembers` pairs are known."""

    def scorer(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        right = torch.zeros_like(targets, dtype=torch.bool)
        for r, (row, target) in enumerate(zip(inputs.tolist(), targets.tolist(), strict=True)):
            asked = [i for i, t in enumerate(target) if t]  # answers: value ids, never 0
            pairs = len(asked)
            known = list(zip(row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2], strict=True))
            table = dict(known[-remembers:] if remembers else known)
            for i in asked:
                right[r, i] = table.get(row[i], -1) == target[i]
        return right

    return scorer


def _guess(value: int):
    def scorer(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets == value

    return scorer


def test_zoologys_example_scored_by_an_oracle_and_a_constant_guess():
    tokens, targets = mqar_layout(
        np.array([[2, 4]]), np.array([[8, 7]]), np.array([[4, 1]]), 16, np.zeros((1, 16))
    )
    tokens, targets = torch.from_numpy(tokens), torch.from_numpy(targets)
    assert recall.recall_accuracy(_oracle(), tokens, targets) == 1.0
    # the two answers are 7 and 8: always guessing 7 answers one of them
    assert recall.recall_accuracy(_guess(7), tokens, targets) == 0.5
    assert recall.recall_accuracy(_guess(9), tokens, targets) == 0.0


def test_grids_of_an_oracle_and_of_a_memory_of_one_pair():
    pairs, lengths = [1, 4, 8], [32, 64]
    full = recall.recall_grid(_oracle(), pairs, lengths, 64, examples=5, seed=0)
    assert full.accuracy == [[1.0, 1.0]] * 3
    assert full.chance == 1 / 32  # a uniform guess among the 32 value ids
    # each key is queried once: knowing only the last pair answers one query in `pairs`
    last = recall.recall_grid(_oracle(remembers=1), pairs, lengths, 64, examples=5, seed=0)
    assert last.accuracy == [[1.0, 1.0], [0.25, 0.25], [0.125, 0.125]]
    assert "recall (MQAR)" in last.table() and "0.125" in last.table()
    with pytest.raises(ConfigError, match="8 pairs need at least 32 tokens"):
        recall.recall_grid(_oracle(), [8], [16, 64], 64, examples=5, seed=0)


def test_the_grid_reads_the_examples_of_its_generator_settings():
    seen = []

    def scorer(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(inputs.clone())
        return torch.zeros_like(targets, dtype=torch.bool)

    recall.recall_grid(scorer, [2], [32], 64, 3, seed=5, power_a=1.0, random_fill=False)
    tokens, _ = mqar_examples(2, 32, 64, 3, [5, 2, 32], 1.0, False)
    assert len(seen) == 1 and torch.equal(seen[0], torch.from_numpy(tokens))


def test_the_run_end_line_reads_the_first_row_by_hand():
    rows = [[1.0, 0.93212, 0.7951], [0.5, 0.5, 0.5]]  # the second row (8 pairs) is not read
    grid = recall.RecallGrid([16, 8], [64, 128, 256], 64, 64, 64, rows, 1 / 32)
    assert grid.run_end_line() == (
        "recall         1.000 of 16 pairs answered in 64-token examples (the trained length); "
        "with the state carried 0.932 at 128 tokens, 0.795 at 256 tokens (chance 0.031, 64 "
        "examples each)"
    )
    one = recall.RecallGrid([4], [32], 8, 64, None, [[0.25]], 1 / 32)  # no trained length
    assert one.run_end_line() == (
        "recall         0.250 of 4 pairs answered in 32-token examples (chance 0.031, 8 "
        "examples each)"
    )


def test_a_bdh_scorer_is_one_calls_greedy_tokens(monkeypatch):
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 32 * 3 * 7)  # 7 tokens a call: chunks carry
    model = tiny_model(torch.float64, seed=3)  # vocab 32
    inputs = torch.randint(0, 32, (5, 40), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 32, (5, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(inputs)
    right = recall.model_scorer(model, batch_size=3)(inputs, targets)
    assert torch.equal(right, logits.argmax(-1) == targets)
    answers = torch.full_like(targets, IGNORE_INDEX)
    answers[:, 20:] = targets[:, 20:]
    expected = float((logits.argmax(-1) == targets)[:, 20:].double().mean())
    scorer = recall.model_scorer(model, batch_size=3)
    assert recall.recall_accuracy(scorer, inputs, answers) == pytest.approx(expected, abs=1e-12)
