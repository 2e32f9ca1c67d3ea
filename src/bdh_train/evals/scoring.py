"""Per-token scoring: the log-probability a model gives each token of a sequence given every
token before it, read with the state carried from chunk to chunk (`read_tokens`), so that a
sequence of any length costs O(length) and its memory is that of one chunk.

Sequences of different lengths are scored together: sorted longest first, cut into batches,
each batch padded on the right. A token's output depends only on the tokens before it, so
the padding after a row's end changes none of that row's scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bdh_train.data.tokenizer import Tokenizer
from bdh_train.errors import BDHTrainError
from bdh_train.model.bdh import BDH
from bdh_train.model.sampling import PREFILL_TOKENS, read_tokens
from bdh_train.model.summary import SummaryEvents

LOGIT_BUDGET = 1 << 24
"""Logits alive at once (elements): a chunk of a batch is at most this many rows x tokens x
vocabulary ids (64 MiB of float32)."""


@dataclass
class TokenScores:
    """A sequence's scores: entry i is about token i + 1, predicted from tokens 0..i."""

    log_probs: np.ndarray
    """float64 [len - 1]: log p(token i + 1 | tokens 0..i), natural log."""
    greedy: np.ndarray
    """bool [len - 1]: token i + 1 is the model's most likely next token."""


def text_model(model: BDH, tokenizer: Tokenizer | None, where: str) -> Tokenizer:
    """`tokenizer`, checked to be the text tokenizer of a token-head `model`; BDHTrainError
    naming `where` otherwise."""
    if tokenizer is None or model.config.language_head.type != "token":
        raise BDHTrainError(
            f"{where} has no text tokenizer: it needs a token-head model with a tokenizer (a "
            "byte-level model, vocab_size 256, or a run that carries its tokenizer.json)"
        )
    return tokenizer


def chunk_for(batch: int, vocab_size: int) -> int:
    """Tokens per call for `batch` rows: within LOGIT_BUDGET and at most PREFILL_TOKENS."""
    return max(1, min(PREFILL_TOKENS, LOGIT_BUDGET // max(1, batch * vocab_size)))


@torch.inference_mode()
def score_batch(
    model: BDH,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    summary_events: SummaryEvents | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) [B, T] float64, targets are the argmax [B, T] bool), both on the CPU,
    of inputs [B, T] read from a fresh state, `chunk_for` tokens per call.

    Log-probabilities are taken in the logits' dtype, float32 at least (a float64 model
    scores in float64)."""
    batch, length = inputs.shape
    device = model.embed.weight.device
    targets = targets.to(device=device, dtype=torch.long)
    log_probs = torch.empty(batch, length, dtype=torch.float64)
    greedy = torch.empty(batch, length, dtype=torch.bool)

    def on_hidden(start: int, hidden: torch.Tensor) -> None:
        logits = model.logits_from_hidden(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        wanted = targets[:, start : start + hidden.shape[1]]
        picked = torch.log_softmax(logits, dim=-1).gather(-1, wanted.unsqueeze(-1)).squeeze(-1)
        log_probs[:, start : start + hidden.shape[1]] = picked.double().cpu()
        greedy[:, start : start + hidden.shape[1]] = (logits.argmax(dim=-1) == wanted).cpu()

    state = model.init_state(batch)
    chunk = chunk_for(batch, model.config.vocab_size)
    read_tokens(model, state, inputs, summary_events, chunk_tokens=chunk, on_hidden=on_hidden)
    return log_probs, greedy


def score_sequences(
    model: BDH,
    sequences: Sequence[Sequence[int]],
    batch_size: int,
    summary_events: SummaryEvents | None = None,
) -> list[TokenScores]:
    """The scores of each sequence (at least two tokens each), in the order given, each read
    from a fresh state; `batch_size` rows at a time, longest first, padded on the right."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    short = [i for i, seq in enumerate(sequences) if len(seq) < 2]
    if short:
        raise ValueError(f"sequences {short[:5]} have fewer than two tokens: nothing to score")
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    out: list[TokenScores | None] = [None] * len(sequences)
    for first in range(0, len(order), batch_size):
        rows = order[first : first + batch_size]
        width = len(sequences[rows[0]]) - 1
        padded = torch.zeros(len(rows), width + 1, dtype=torch.long)
        for r, i in enumerate(rows):
            padded[r, : len(sequences[i])] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
        log_probs, greedy = score_batch(model, padded[:, :-1], padded[:, 1:], summary_events)
        for r, i in enumerate(rows):
            n = len(sequences[i]) - 1
            out[i] = TokenScores(log_probs[r, :n].numpy(), greedy[r, :n].numpy())
    return [s for s in out if s is not None]


def score_continuations(
    model: BDH,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int,
    summary_events: SummaryEvents | None = None,
) -> list[tuple[float, bool]]:
    """For each (context, continuation) of ids, the context at least one token: (the sum of
    log p(continuation | context), whether greedy decoding after the context gives exactly
    the continuation, i.e. each of its tokens is the most likely one after those before it).
    An empty continuation is (0.0, True)."""
    scored = [i for i, (_, cont) in enumerate(pairs) if len(cont)]
    sequences = [[*pairs[i][0], *pairs[i][1]] for i in scored]
    scores = score_sequences(model, sequences, batch_size, summary_events)
    out = [(0.0, True)] * len(pairs)
    for i, s in zip(scored, scores, strict=True):
        n = len(pairs[i][1])
        out[i] = (float(s.log_probs[-n:].sum()), bool(s.greedy[-n:].all()))
    return out
