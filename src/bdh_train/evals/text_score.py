"""`score_text`: the loss of one text under a model, read `SCORE_CHUNK_TOKENS` at a time with
the state carried, as nats per token and bits per UTF-8 byte."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdh_train.data.tokenizer import (
    Tokenizer,
)
from bdh_train.errors import DataError
from bdh_train.model import BDH
from bdh_train.model.sampling import read_tokens
from bdh_train.shared.loading import encode_text
from bdh_train.train.evaluate import bits_per_byte


@dataclass(frozen=True)
class TextScore:
    """How well a model predicts a text (`score_text`)."""

    loss: float
    """Mean loss in nats per predicted token (every token after the first)."""
    tokens: int
    """Predicted tokens."""
    bits_per_byte: float
    """The summed loss in bits per UTF-8 byte of the predicted tokens."""


SCORE_CHUNK_TOKENS = 1024
"""`score_text` reads a text this many tokens per call, the state carried between calls."""


@torch.no_grad()
def score_text(
    model: BDH, tokenizer: Tokenizer, text: str, chunk_tokens: int = SCORE_CHUNK_TOKENS
) -> TextScore:
    """The loss of `model` on `text` without gradients: each token after the first predicted
    from all the text before it (read `chunk_tokens` at a time with the carried state, so
    memory does not grow with the text), in nats per token and bits per byte."""
    ids = torch.as_tensor(encode_text(tokenizer, text, "the text"), dtype=torch.long)
    if ids.numel() < 2:
        raise DataError(f"the text is {ids.numel()} token(s): scoring needs at least 2")
    device = model.embed.weight.device
    inputs, targets = ids[:-1].to(device), ids[1:].to(device)
    total = 0.0

    def add_loss(start: int, hidden: torch.Tensor) -> None:
        nonlocal total
        wanted = targets[start : start + hidden.shape[1]].unsqueeze(0)
        total += float(model.loss_from_hidden(hidden, wanted, reduction="sum"))

    read_tokens(
        model,
        model.init_state(1),
        inputs.unsqueeze(0),
        chunk_tokens=chunk_tokens,
        on_hidden=add_loss,
    )
    lengths = torch.as_tensor(tokenizer.token_byte_lengths(), dtype=torch.int64)
    text_bytes = int(lengths[targets.cpu()].sum())
    return TextScore(total / targets.numel(), targets.numel(), bits_per_byte(total, text_bytes))
