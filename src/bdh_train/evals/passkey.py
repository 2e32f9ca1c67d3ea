"""Passkey retrieval: a needle in a haystack, for any text model.

A prompt of exactly L tokens is filler text with the needle ("The pass key is 12345.
Remember it. 12345 is the pass key.") planted at depth d (0: at the start, 1: just before
the question; at the filler sentence boundary nearest d of the way), then the question
"What is the pass key? The pass key is". The answer is " " + the key. A trial is answered
when greedy decoding after the prompt gives exactly the answer's tokens, which is when each
answer token is the most likely one after the prompt and the answer tokens before it: one
scoring pass over prompt + answer (`score_continuations`) gives that and the answer's
log-probability. Accuracy over `trials` random keys per (d, L) cell is the heat map.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bdh_train.data.tokenizer import Tokenizer
from bdh_train.errors import ConfigError
from bdh_train.evals.context import plot_grid

FILLER = (
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
KEY_DIGITS = 5
BYTES_PER_PROMPT_TOKEN = 64
"""Host memory one prompt token of a cell may take while it is scored, an upper bound: its
id in the prompt list (a pointer and an int object), the padded input and target rows, the
float64 log-probability and the greedy flag."""

Scorer = Callable[[list[tuple[list[int], list[int]]]], list[tuple[float, bool]]]
"""(prompt ids, answer ids) pairs -> (log p(answer | prompt), greedy decoding gives exactly
the answer), as `score_continuations` gives them."""


@dataclass
class PasskeyGrid:
    """Accuracy (and the answer's mean log-probability per token) per depth x length."""

    lengths: list[int]
    depths: list[float]
    trials: int
    accuracy: list[list[float]]
    """accuracy[i][j]: depth i, length j; the fraction of trials answered."""
    answer_log_prob: list[list[float]]
    """Mean log p per answer token, natural log, over the cell's trials."""

    def table(self) -> str:
        head = f"{'depth':>7}" + "".join(f"{length:>10,}" for length in self.lengths)
        lines = [f"passkey: accuracy over {self.trials} keys per cell (rows: depth)", head]
        for depth, row in zip(self.depths, self.accuracy, strict=True):
            lines.append(f"{depth:>7.2f}" + "".join(f"{a:>10.2f}" for a in row))
        return "\n".join(lines)


def check_fits(
    lengths: Sequence[int],
    trials: int,
    available: int,
    where: str,
    options: tuple[str, str] = ("--passkey-lengths", "--passkey-trials"),
) -> None:
    """ConfigError, before anything is built, when one cell's prompts (`trials` of the
    longest length) would take more than `available` bytes of host memory; `options` names
    the lengths' and the trials' options in the message."""
    need = max(lengths) * trials * BYTES_PER_PROMPT_TOKEN
    if need > available:
        raise ConfigError(
            f"{options[0]} {max(lengths):,} needs about {need / 2**30:,.1f} GiB for "
            f"{trials} prompts of that length, more than {where} holds "
            f"({available / 2**30:,.1f} GiB): pass shorter lengths or fewer {options[1]}"
        )


def _sentences(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(s) for s in FILLER]


def passkey_prompt(
    tokenizer: Tokenizer, length: int, depth: float, key: str
) -> tuple[list[int], list[int]]:
    """(prompt ids, exactly `length` of them, answer ids) with the needle holding `key` at
    `depth` of the filler; ConfigError when `length` leaves no room for filler."""
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    fill = length - len(needle) - len(question)
    if fill < 1:
        raise ConfigError(
            f"--passkey-lengths {length} is too short: the needle and the question alone are "
            f"{len(needle) + len(question)} tokens"
        )
    hay: list[int] = []
    bounds = [0]
    sentences = _sentences(tokenizer)
    while len(hay) < fill:
        hay.extend(sentences[(len(bounds) - 1) % len(sentences)])
        bounds.append(len(hay))
    hay = hay[:fill]
    bounds = [b for b in bounds if b < fill] + [fill]  # the end too: depth 1 is just before Q
    at = min(bounds, key=lambda b: abs(b - depth * fill))
    prompt = hay[:at] + needle + hay[at:] + question
    return prompt, tokenizer.encode(" " + key)


def passkey_grid(
    scorer: Scorer,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int = 0,
) -> PasskeyGrid:
    """Accuracy of `scorer` over `trials` keys (random, `seed`) at each depth x length."""
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or trials < 1 or not lengths or not depths:
        raise ConfigError(
            f"--passkey-depths must lie in [0, 1] (got {list(depths)}) and --passkey-trials "
            f"must be at least 1 (got {trials})"
        )
    rng = random.Random(seed)
    accuracy: list[list[float]] = []
    answer_log_prob: list[list[float]] = []
    for depth in depths:
        accuracy.append([])
        answer_log_prob.append([])
        for length in lengths:
            keys = [
                str(rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)) for _ in range(trials)
            ]
            pairs = [passkey_prompt(tokenizer, length, depth, key) for key in keys]
            results = scorer(pairs)
            accuracy[-1].append(float(np.mean([ok for _, ok in results])))
            per_token = [
                lp / len(answer) for (lp, _), (_, answer) in zip(results, pairs, strict=True)
            ]
            answer_log_prob[-1].append(float(np.mean(per_token)))
    return PasskeyGrid(list(lengths), list(depths), trials, accuracy, answer_log_prob)


def plot_passkey(grid: PasskeyGrid, path: str | os.PathLike[str]) -> Path:
    """The accuracy heat map (depth x length), each cell labelled, written atomically."""
    return plot_grid(
        grid.accuracy,
        [f"{n:,}" for n in grid.lengths],
        [f"{d:.2f}" for d in grid.depths],
        "prompt length (tokens)",
        "needle depth",
        f"passkey accuracy ({grid.trials} keys per cell)",
        path,
    )
