"""Validation: the mean loss over counted targets of a fixed set of batches, and bits per byte
where the tokens are text of a tokenizer. One recipe (`Evaluator`, over `evaluate`) serves the
trainer and `bdh-train eval`; one rule (`text_tokenizer`) says when bits per byte are reported
and when a run's samples are text.
Data-parallel ranks each take every world-th batch and add their sums together.

Bits per byte (the one rule): the loss in nats summed over the counted targets, divided by
ln 2 and by the UTF-8 bytes those same targets decode to (`Tokenizer.token_byte_lengths`,
counted with the head's own mask, `heads.counted_target_mask`). For the byte tokenizer every
target is one byte, so it is the mean loss / ln 2; for a BPE it compares across vocabularies.

Activity (`Evaluator.activity_of`): the same forward passes, recorded by model/activity.py's
`ActivityCounts` (shares of positive x, yg and x * yg, dead and always-on neurons, over all
layers and per layer); no extra pass over any data.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from bdh_train.batch import SequenceBatch
from bdh_train.data.config import DataConfig, is_text_of
from bdh_train.data.eval_windows import eval_batches, eval_window_count
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.tokenizer import BYTES, Tokenizer
from bdh_train.data.tokens import TokenData
from bdh_train.errors import DataError
from bdh_train.model import sampling
from bdh_train.model.activity import ActivityCounts, recording
from bdh_train.model.bdh import BDH
from bdh_train.model.config import BDHConfig, LanguageHeadConfig
from bdh_train.model.heads import counted_target_mask
from bdh_train.model.sampling import check_finite_weights
from bdh_train.train.config import every_and_last


class EvalLoss(Protocol):
    def eval_loss(self, batch: SequenceBatch) -> tuple[float, float]:
        """(loss sum over counted targets, counted targets) of `batch`, without a graph."""
        ...


@dataclass
class EvalResult:
    """One evaluation: the mean loss over the counted targets, how many there were, and bits
    per byte where the data is text of a tokenizer."""

    val_loss: float
    """Mean loss (nats) per counted target."""
    tokens: int
    """Counted targets the mean is over."""
    bits_per_byte: float | None
    """The loss in bits per UTF-8 byte of the text; None when the tokens are not text of a
    tokenizer."""
    activity: dict[str, float] | None = None
    """`ActivityCounts.row` of the evaluated tokens, when recorded."""

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"val_loss": self.val_loss}
        if self.bits_per_byte is not None:
            out["bits_per_byte"] = self.bits_per_byte
        return out | (self.activity or {})


def counted_target_bytes(
    targets: torch.Tensor, byte_lengths: torch.Tensor, head: LanguageHeadConfig
) -> int:
    """The UTF-8 bytes the targets the head counts decode to: byte_lengths[t] summed over
    the counted targets t."""
    counted = counted_target_mask(targets, head)
    flat = targets.reshape(-1).to(byte_lengths.device)
    counted = counted.to(byte_lengths.device)
    return int(byte_lengths[torch.where(counted, flat, 0)][counted].sum())


def bits_per_byte(loss_sum: float, text_bytes: float) -> float:
    """Nats summed over targets -> bits per byte of the text those targets are."""
    return loss_sum / text_bytes / math.log(2)


def evaluate(
    step: EvalLoss,
    data: TokenData,
    block_size: int,
    batch_size: int,
    max_batches: int | None,
    device: torch.device | str = "cpu",
    summary_trigger: SummaryEventTrigger | None = None,
    byte_lengths: np.ndarray | None = None,
    head: LanguageHeadConfig | None = None,
    part: tuple[int, int] = (0, 1),
    add_across_ranks: Callable[[list[float]], list[float]] | None = None,
    progress: Callable[[], object] | None = None,
) -> EvalResult:
    """Every token after the first of the first `max_batches` eval batches, predicted once
    (with their summary event masks when there is a trigger).

    `byte_lengths` ([vocab] UTF-8 bytes per id, `Tokenizer.token_byte_lengths()`) is given
    when `data` is text of that tokenizer: bits per byte is then reported; `head` is the
    model's output head, whose counted targets the bytes are summed over (default: the token
    head).

    With `part = (rank, world)` this process evaluates batches rank, rank + world, ... and
    `add_across_ranks` (an all-reduce SUM over the data-parallel ranks) turns its sums into
    the sums over all batches, so every rank returns the one-process result. `progress` is
    called after each batch."""
    head = head if head is not None else LanguageHeadConfig()
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.int64)
    rank, world = part
    total, count, text_bytes = 0.0, 0.0, 0.0
    batches = eval_batches(data, block_size, batch_size, max_batches, summary_trigger)
    for batch in itertools.islice(batches, rank, None, world):
        loss_sum, counted = step.eval_loss(batch.to(device))
        total += loss_sum
        count += counted
        if lengths is not None:
            text_bytes += counted_target_bytes(batch.targets, lengths, head)
        if progress is not None:
            progress()
    if add_across_ranks is not None:
        total, count, text_bytes = add_across_ranks([total, count, text_bytes])
    if count == 0:  # a mean over nothing is no number, least of all 0.0
        raise DataError(
            f"evaluation counted no tokens ({max_batches} batches of {data.source}); "
            "give at least one batch of data longer than one token"
        )
    val_loss = total / count
    bits = bits_per_byte(total, text_bytes) if lengths is not None and text_bytes else None
    return EvalResult(val_loss, int(count), bits)


def validation_source(data: DataConfig) -> str:
    """The source a run's validation split is named by: data.val_source, else data.source
    (whose split it then is)."""
    return data.source if data.val_source is None else data.val_source


def text_tokenizer(tokenizer: Tokenizer, source: str) -> Tokenizer | None:
    """`tokenizer` when the ids of `source` are text of it, else None (`is_text_of`: not
    generated data, and not a ``.bin`` of ids under the byte tokenizer)."""
    return tokenizer if is_text_of(source, tokenizer.kind == BYTES) else None


@dataclass
class Evaluator:
    """A run's validation: `evaluate` of its step executor on its validation data with the
    run's block and batch sizes, summary trigger and head, in bits per byte too when the data
    is text of the run's tokenizer (`text_of`). Due every `every` optimizer steps and at
    `last_step`."""

    executor: EvalLoss
    data: TokenData
    block_size: int
    batch_size: int
    max_batches: int | None
    device: torch.device | str
    summary_trigger: SummaryEventTrigger | None
    head: LanguageHeadConfig
    text_of: Tokenizer | None
    """The tokenizer the data is text of (`text_tokenizer`), else None."""
    part: tuple[int, int] = (0, 1)
    add_across_ranks: Callable[[list[float]], list[float]] | None = None
    every: int = 0
    last_step: int = 0
    progress: Callable[[], object] | None = None
    """Called after each batch (`bdh-train eval`'s progress bar)."""
    activity_of: BDH | None = None
    """The model whose neurons' activity the evaluation's own forwards record, else None."""

    def should_evaluate(self, step: int) -> bool:
        return every_and_last(step, self.every, self.last_step)

    def run(self) -> EvalResult:
        counts = None
        with contextlib.ExitStack() as stack:
            if self.activity_of is not None:
                c = self.activity_of.config
                counts = ActivityCounts(c.n_layer, c.n_head, c.n_neurons, self.device)
                stack.enter_context(recording(self.activity_of, counts))
            result = self._evaluate()
        if counts is not None:
            if self.add_across_ranks is not None:
                counts.set_counts(_summed(counts.counts(), self.add_across_ranks))
            result.activity = counts.row()
        return result

    def _evaluate(self) -> EvalResult:
        text_of = self.text_of
        return evaluate(
            self.executor,
            self.data,
            self.block_size,
            self.batch_size,
            self.max_batches,
            self.device,
            self.summary_trigger,
            byte_lengths=None if text_of is None else text_of.token_byte_lengths(),
            head=self.head,
            part=self.part,
            add_across_ranks=self.add_across_ranks,
            progress=self.progress,
        )

    @property
    def coverage(self) -> tuple[int, int]:
        """(batches, tokens): what `run` reads, the tokens being the targets of its windows."""
        windows = eval_window_count(len(self.data), self.block_size)
        if self.max_batches is not None:
            windows = min(windows, self.max_batches * self.batch_size)
        return self.batch_count, windows * self.block_size

    @property
    def batch_count(self) -> int:
        """The batches `run` evaluates (of this process and its data-parallel peers)."""
        windows = eval_window_count(len(self.data), self.block_size)
        batches = -(-windows // self.batch_size)
        return batches if self.max_batches is None else min(batches, self.max_batches)


def _summed(
    counts: list[torch.Tensor], add: Callable[[list[float]], list[float]]
) -> list[torch.Tensor]:
    """`counts` added over the ranks by `add` (float64 sums: exact below 2**53)."""
    flat = torch.cat([c.reshape(-1) for c in counts]).double()
    summed = torch.tensor(add(flat.tolist()), dtype=torch.float64)
    pieces = summed.split([c.numel() for c in counts])
    return [p.view(c.shape).to(c) for p, c in zip(pieces, counts, strict=True)]


SAMPLE_PROMPT_TOKENS = 32
"""The end-of-run sample continues this many tokens of the validation (else train) data."""

SAMPLE_TOKENS = 200
"""How many tokens each end-of-run sample continues its prompt by."""
SAMPLE_TEMPERATURES = (0.8, 0.5)
"""The end-of-run samples' temperatures: the usual one, then a lower one, whose text keeps
to the model's likeliest words (a young model's 0.8 sample wanders more)."""


def sample_prompt(ids: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
    """The longest prefix of `ids` (at least one token) that decodes to whole UTF-8
    characters, so neither the prompt nor its continuation is printed with a character cut
    in two."""
    n = len(ids)
    while n > 1:
        try:
            tokenizer.decode_bytes(ids[:n]).decode("utf-8")
            break
        except UnicodeDecodeError:
            n -= 1
    return np.asarray(ids[:n], dtype=np.int64)


def sample_continuation(
    model: BDH,
    tokenizer: Tokenizer,
    model_config: BDHConfig,
    data_config: DataConfig,
    splits: tuple[TokenData, TokenData | None],
    device: torch.device,
    max_new_tokens: int = SAMPLE_TOKENS,
    where: str = "the trained model",
    temperature: float = SAMPLE_TEMPERATURES[0],
) -> tuple[str, str] | None:
    """(prompt, continuation) of the end-of-run sample: the first `SAMPLE_PROMPT_TOKENS` of
    the validation (else train) split of `splits` continued by `model` at `temperature`,
    top-k 50, seed 0, decoded; None unless the model writes text of `tokenizer`
    (`writes_text`). Weights holding NaN or infinity are a NonFiniteModelError naming
    `where` (what the weights are: 'checkpoint RUN/...')."""
    train, val = splits
    data, source = (
        (train, data_config.source) if val is None else (val, validation_source(data_config))
    )
    if not writes_text(model_config.language_head, model_config.vocab_size, tokenizer, source):
        return None
    check_finite_weights(model, where)
    prompt = torch.as_tensor(
        sample_prompt(data.tokens[:SAMPLE_PROMPT_TOKENS], tokenizer), device=device
    )
    model.eval()
    out = sampling.generate(
        model,
        prompt,
        max_new_tokens,
        temperature=temperature,
        top_k=50,
        generator=torch.Generator(device).manual_seed(0),
        summary_events=data_config.summary_trigger(),
    )
    model.train()
    return tokenizer.decode(out[: len(prompt)].tolist()), tokenizer.decode(
        out[len(prompt) :].tolist()
    )


def end_of_run_samples(
    model: BDH,
    tokenizer: Tokenizer,
    model_config: BDHConfig,
    data_config: DataConfig,
    splits: tuple[TokenData, TokenData | None],
    device: torch.device,
    max_new_tokens: int = SAMPLE_TOKENS,
) -> tuple[str, list[tuple[float, str]]] | None:
    """A run's end-of-run samples: (prompt, [(temperature, continuation)]) of
    `sample_continuation` at each of SAMPLE_TEMPERATURES; None when the model does not write
    text of `tokenizer`."""
    prompt, samples = "", []
    for temperature in SAMPLE_TEMPERATURES:
        out = sample_continuation(
            model,
            tokenizer,
            model_config,
            data_config,
            splits,
            device,
            max_new_tokens,
            temperature=temperature,
        )
        if out is None:
            return None
        prompt = out[0]
        samples.append((temperature, out[1]))
    return prompt, samples


def writes_text(
    head: LanguageHeadConfig, vocab_size: int, tokenizer: Tokenizer, source: str
) -> bool:
    """Whether a model's samples are text of `tokenizer`: a token head over the tokenizer's
    whole vocabulary, trained on text of it (`source`, `text_tokenizer`)."""
    return (
        head.type == "token"
        and vocab_size == tokenizer.vocab_size
        and text_tokenizer(tokenizer, source) is not None
    )
