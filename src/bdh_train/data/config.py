"""`[data]`: where tokens come from, the validation split, and the options of generated data.

The names a source may take live here and in `sources`: `builtin:<name>` for the corpora in
`sources.BUILTIN_CORPORA`, a name in `GENERATED_SOURCES`, or a filesystem path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bdh_train import checks
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.formats import TEXT_FIELD
from bdh_train.data.layout import is_prepared_split, prepared_directory, tokens_file
from bdh_train.data.mqar import MqarConfig, mqar_source
from bdh_train.data.nca import NcaConfig, nca_source
from bdh_train.data.sources import (
    BUILTIN_CORPORA,
    BUILTIN_PREFIX,
    TokenGenerator,
    load_splits,
    load_tokens,
)
from bdh_train.data.tokenizer import (
    BYTES,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from bdh_train.data.tokens import TOKEN_DTYPES, VAL_FRACTION, TokenData
from bdh_train.errors import ConfigError
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.utils import suggest

GENERATED_SOURCES: dict[str, Callable[[DataConfig], TokenGenerator]] = {
    "nca": lambda cfg: lambda vocab_size: nca_source(cfg.nca, vocab_size),
    "mqar": lambda cfg: lambda vocab_size: mqar_source(cfg.mqar, vocab_size),
}
"""Source names served by a generator built from the data config, instead of a file."""


def is_text_of(source: str, byte_tokenizer: bool) -> bool:
    """Whether the ids of `source` are text of the run's tokenizer, so a loss per token
    converts to bits per byte and its first tokens decode to a prompt. Generated data is not;
    with the byte tokenizer, neither is a ``.bin`` of token ids (its ids stand for no
    declared text); with a Hugging Face tokenizer every other source is (text is encoded with
    it, token files are declared to be of it)."""
    if source in GENERATED_SOURCES:
        return False
    return not byte_tokenizer or not source.endswith(".bin")


@dataclass
class DataConfig:
    """Where tokens come from. The vocabulary size is the model's (``model.vocab_size``)."""

    source: str = "builtin:pydoc"
    """``builtin:<name>``, a generated source (``nca``, ``mqar``), or a path: a directory written by
    ``bdh-train prepare``; a ``.bin`` token file (``.json`` header, a split of a prepared
    directory, or headerless with ``bin_dtype``); a text file (``.txt`` or any other name,
    UTF-8), ``.jsonl``/``.json`` lines or ``.parquet`` (``text_field`` holds the text), any
    of these ``.gz``/``.zst``; or a directory of such files (recursive, sorted; a file of
    another name counts when its first 8 KiB are UTF-8 without NUL bytes, so binary files are
    skipped: the rule ``bdh-train prepare`` applies to a directory too)."""
    val_fraction: float = VAL_FRACTION
    """The share of the tokens held out for validation, taken from the end (0 = none). Used
    only when neither ``val_source`` is set nor ``source`` is a prepared directory with a
    validation split (those win, in that order)."""
    val_source: str | None = None
    """A separate validation set (any form ``source`` takes; a prepared directory gives its
    training split, so name ``DIR/val.bin`` for its validation split), or None."""
    tokenizer: str = "bytes"
    """``bytes`` (every UTF-8 byte is a token) or the path of a Hugging Face ``tokenizer.json``;
    ``model.vocab_size`` follows its vocabulary size unless a config file or --set gives it
    (then it must be equal). A run keeps a copy and its saved config names that copy."""
    bin_dtype: str | None = None
    """The id dtype (``uint16`` or ``uint32``) of a headerless ``.bin`` token file (nanoGPT
    style); None requires the ``<file>.json`` header."""
    text_field: str = TEXT_FIELD
    """The field of ``.jsonl``/``.json`` lines (the column of ``.parquet``) holding the text."""
    nca: NcaConfig = field(default_factory=NcaConfig)
    """The generated NCA corpus (data.source = "nca")."""
    mqar: MqarConfig = field(default_factory=MqarConfig)
    """The generated multi-query associative recall corpus (data.source = "mqar")."""
    summary_write_trigger_text: str | None = None
    """Text whose bytes, read in a row, make a summary event at the last byte (None = off)."""
    summary_write_trigger_token_ids: list[int] | None = None
    """Token ids each of which is a summary event (None = off)."""

    def validate(self, prefix: str = "data") -> DataConfig:
        checks.string(f"{prefix}.source", self.source)
        if not self.source:
            raise ConfigError(
                f"{prefix}.source must be 'builtin:<name>', "
                f"{', '.join(map(repr, GENERATED_SOURCES))} or a path, got ''"
            )
        if self.source.startswith(BUILTIN_PREFIX):
            name = self.source[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_CORPORA:
                raise ConfigError(
                    f"{prefix}.source names an unknown builtin corpus {name!r}; known: "
                    f"{', '.join(BUILTIN_PREFIX + b for b in BUILTIN_CORPORA)}"
                    f"{suggest(name, BUILTIN_CORPORA)}"
                )
        checks.number(f"{prefix}.val_fraction", self.val_fraction, low=0.0, high=1.0)
        if self.val_source is not None:
            checks.string(f"{prefix}.val_source", self.val_source)
        checks.string(f"{prefix}.tokenizer", self.tokenizer)
        checks.string(f"{prefix}.text_field", self.text_field)
        if self.bin_dtype is not None:
            checks.choice(f"{prefix}.bin_dtype", self.bin_dtype, TOKEN_DTYPES)
        self.nca.validate(f"{prefix}.nca")
        self.mqar.validate(f"{prefix}.mqar")
        text, ids = self.summary_write_trigger_text, self.summary_write_trigger_token_ids
        if text is not None and (not isinstance(text, str) or not text):
            raise ConfigError(
                f"{prefix}.summary_write_trigger_text must be a non-empty string or unset, "
                f"got {text!r}"
            )
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ConfigError(
                    f"{prefix}.summary_write_trigger_token_ids must be a non-empty list of "
                    f"token ids or unset, got {ids!r}"
                )
            for token in ids:
                checks.nonneg_int(f"{prefix}.summary_write_trigger_token_ids[]", token)
        return self

    def summary_trigger(self) -> SummaryEventTrigger | None:
        """The summary write trigger (text as bytes: the models are byte-level), or None."""
        text, ids = self.summary_write_trigger_text, self.summary_write_trigger_token_ids
        if text is None and ids is None:
            return None
        sequence = tuple(ByteTokenizer().encode(text)) if text is not None else ()
        return SummaryEventTrigger(sequence, tuple(int(i) for i in ids or ()))

    def check_summary_memory(
        self, summary: SummaryMemoryConfig, vocab_size: int, prefix: str = "data"
    ) -> None:
        """A trigger drives the summary memory's write gate: one without the other is an
        error, and its ids must be tokens of the model's vocabulary."""
        trigger = self.summary_trigger()
        keys = f"{prefix}.summary_write_trigger_text / _token_ids"
        if trigger is not None and not summary.write_gate:
            raise ConfigError(
                f"{keys} mark summary events for the summary memory's write gate: set "
                "model.summary_memory.enabled=true and model.summary_memory.write_gate=true, "
                "or unset the trigger"
            )
        if trigger is None and summary.write_gate:
            raise ConfigError(
                "model.summary_memory.write_gate=true writes only at summary events: set "
                f"{keys}, or set write_gate=false"
            )
        if trigger is not None:
            for key, tokens in (
                (f"{prefix}.summary_write_trigger_text", trigger.sequence),
                (f"{prefix}.summary_write_trigger_token_ids", trigger.ids),
            ):
                if tokens and max(tokens) >= vocab_size:
                    raise ConfigError(
                        f"{key} holds token id {max(tokens)}, outside model.vocab_size "
                        f"({vocab_size})"
                    )

    def resolved_source(self) -> str:
        """The source as a run stores it: a filesystem path made absolute (``~`` expanded),
        so the run's config reads the same data from any working directory; builtin and
        generated names unchanged."""
        if not self.is_a_path:
            return self.source
        return os.path.abspath(os.path.expanduser(self.source))

    @property
    def is_a_path(self) -> bool:
        """Whether the source names a file or directory (not a builtin corpus or a generated
        source)."""
        return not (self.is_generated or self.source.startswith(BUILTIN_PREFIX))

    @property
    def is_byte_text(self) -> bool:
        """Whether the source is text read as bytes (ids 0..255): a builtin corpus, a text
        source, a prepared directory or one of its split files (``DIR/train.bin``) with
        ``data.tokenizer = "bytes"``; not a generated source, another ``.bin`` token file or
        text under another tokenizer."""
        if self.is_generated or self.tokenizer != BYTES:
            return False
        path = Path(self.source).expanduser()
        return path.suffix != ".bin" or is_prepared_split(path)

    def load_tokenizer(self) -> ByteTokenizer | HFTokenizer:
        """The tokenizer ``data.tokenizer`` names (DataError when it cannot be loaded)."""
        return load_tokenizer(self.tokenizer)

    def is_text_of_tokenizer(self, source: str | None = None) -> bool:
        """Whether `source` (default ``data.source``) is text in ``data.tokenizer``'s ids
        (`is_text_of`)."""
        return is_text_of(self.source if source is None else source, self.tokenizer == BYTES)

    @property
    def is_generated(self) -> bool:
        return self.source in GENERATED_SOURCES

    def generators(self) -> dict[str, TokenGenerator]:
        """The token generators `load_tokens` needs for this config's generated sources."""
        return {name: make(self) for name, make in GENERATED_SOURCES.items()}

    def load_splits(self, vocab_size: int, block_size: int) -> tuple[TokenData, TokenData | None]:
        """(train, validation) token data, each long enough for `block_size`."""
        return load_splits(
            self.source,
            vocab_size,
            block_size,
            self.val_fraction,
            self.generators(),
            tokenizer=self.load_tokenizer(),
            bin_dtype=self.bin_dtype,
            val_source=self.val_source,
            text_field=self.text_field,
        )

    def load_source(
        self, source: str, vocab_size: int, tokenizer: Tokenizer | None = None
    ) -> TokenData:
        """Any other source (e.g. held-out eval data), read like ``source`` (this config's
        generators, bin_dtype and text_field, and its tokenizer unless `tokenizer` is given:
        an export carries its own)."""
        return load_tokens(
            source,
            vocab_size,
            self.generators(),
            tokenizer=self.load_tokenizer() if tokenizer is None else tokenizer,
            bin_dtype=self.bin_dtype,
            text_field=self.text_field,
        )

    def evaluation_data(
        self,
        source: str | None,
        vocab_size: int,
        block_size: int | None,
        tokenizer: Tokenizer | None = None,
    ) -> TokenData:
        """The tokens `bdh-train eval`, `inspect` and the memory measures read: `source`
        (their --data; a prepared corpus gives its validation split when it has one) read
        with `tokenizer` (default: this config's), else the run's validation split, the one
        training validates on (`load_splits`). A run without one (data.val_fraction = 0 and
        no data.val_source) is a ConfigError asking for --data: nothing is evaluated on the
        data the model trained on unless --data names it. `block_size`: the tokens hold at
        least one window of block_size + 1 (None: any length, for a stream read whole)."""
        if source:
            corpus = Path(source).expanduser()
            if prepared_directory(corpus) == corpus and (corpus / tokens_file("val")).is_file():
                source = str(corpus / tokens_file("val"))
            tokens = self.load_source(source, vocab_size, tokenizer)
            if block_size is not None:
                tokens.validate_for_block(block_size, "eval data")
            return tokens
        _, val = self.load_splits(vocab_size, 1 if block_size is None else block_size)
        if val is None:
            raise ConfigError(
                "the run has no validation split (data.val_fraction = 0); pass --data SOURCE"
            )
        return val
