"""Documents into one token stream: how the prepared corpus writes a split
(`prepared.prepare_corpus`) and how a text source is tokenized into memory
(`sources.load_tokens`), by the same writer.

Documents are concatenated in order. A tokenizer with an end-of-document id gets it after
each document; the byte tokenizer has none, and a newline goes between documents instead (as
between the files of a directory source). `doc_starts` mark each document's first token;
a document that encodes to no ids is left out (no start, no end-of-document id). A tokenizer
with neither an end-of-document id nor ids for "\n" is refused.
Text bytes of a split are the UTF-8 bytes its tokens decode to (separators included, EOT 0).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO

import numpy as np

from bdh_train.data import formats
from bdh_train.data.layout import INDEX_DTYPE
from bdh_train.data.tokenizer import BYTES, EOT_NAMES, Tokenizer
from bdh_train.data.tokens import TokenData, token_dtype_for
from bdh_train.errors import DataError

BATCH_CHARS = 4 << 20
"""Characters of text tokenized per `encode_batch` call."""


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Ids of each text. The byte tokenizer's are the UTF-8 bytes, read straight into an
    array (the same ids as `tokenizer.encode_batch`, without a Python int per byte)."""
    if tokenizer.kind == BYTES:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]


def document_separator(tokenizer: Tokenizer) -> np.ndarray:
    """The ids that part two documents of a split: the end-of-document id (written after each
    document), else the ids of a newline (written between documents). A tokenizer with
    neither is a DataError."""
    if tokenizer.eot_id is not None:
        return np.array([tokenizer.eot_id], dtype=np.int64)
    between = encode_texts(tokenizer, ["\n"])[0]
    if between.size == 0:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'source', tokenizer.kind)} has no "
            f"end-of-document token ({', '.join(EOT_NAMES)}) and encodes a newline to "
            f"nothing, so documents would run together: add one of those special tokens "
            f"to it, or use a tokenizer that keeps newlines"
        )
    return between


class SplitWriter:
    """One split's token stream, written as documents arrive: the separator rule of the
    module docstring, the document starts, and the token and text byte counts. A document
    starts at its first token: one whose text encodes to no ids is no document (no start,
    no end-of-document id), so every recorded start is below the token count."""

    def __init__(self, tokenizer: Tokenizer, dtype: str, tokens: BinaryIO, index: BinaryIO) -> None:
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._tokens, self._index = tokens, index
        self._lengths = tokenizer.token_byte_lengths()
        self.eot_id = tokenizer.eot_id
        separator = document_separator(tokenizer)
        self._between = None if self.eot_id is not None else separator
        self.n_tokens = self.n_documents = self.text_bytes = 0
        self._open = False  # a document has tokens and is not yet ended
        self._starting = False  # a document began and has no tokens yet

    def _write(self, ids: np.ndarray) -> None:
        if ids.size:
            self._tokens.write(ids.astype(self.dtype, copy=False).tobytes())
            self.n_tokens += int(ids.size)
            self.text_bytes += int(self._lengths[ids].sum())

    def begin_document(self) -> None:
        self._end_document()
        self._starting = True

    def add(self, ids: np.ndarray) -> None:
        if not (self._open or self._starting):
            raise AssertionError("SplitWriter.add before begin_document")
        if not ids.size:
            return
        if self._starting:
            if self._between is not None and self.n_documents:
                self._write(self._between)
            self._index.write(np.array([self.n_tokens], dtype=INDEX_DTYPE).tobytes())
            self.n_documents += 1
            self._open, self._starting = True, False
        self._write(ids)

    def _end_document(self) -> None:
        if self._open and self.eot_id is not None:
            self._write(np.array([self.eot_id], dtype=np.int64))
        self._open = self._starting = False

    def close(self) -> None:
        self._end_document()
        self._tokens.flush()
        self._index.flush()


def write_pieces(
    pieces: Iterable[formats.Piece],
    tokenizer: Tokenizer,
    route: Callable[[int], SplitWriter],
    on_batch: Callable[[int, int], None] = lambda source_bytes, tokens: None,
) -> int:
    """Tokenize `pieces` in batches of about `BATCH_CHARS` characters and append them to the
    writer `route(document_index)` picks for each document; returns the documents seen.
    `on_batch(source bytes read, tokens written)` follows the progress."""
    documents = 0
    batch: list[tuple[SplitWriter, bool, str]] = []
    chars = consumed = 0
    writer: SplitWriter | None = None

    def flush() -> None:
        nonlocal chars, consumed
        before = sum({id(w): w.n_tokens for w, _, _ in batch}.values())
        encoded = encode_texts(tokenizer, [text for _, _, text in batch])
        for (target, starts, _), ids in zip(batch, encoded, strict=True):
            if starts:
                target.begin_document()
            target.add(ids)
        after = sum({id(w): w.n_tokens for w, _, _ in batch}.values())
        on_batch(consumed, after - before)
        batch.clear()
        chars = consumed = 0

    for piece in pieces:
        consumed += piece.source_bytes
        if piece.starts_document:
            writer = route(documents)
            documents += 1
        if writer is not None and (piece.text or piece.starts_document):
            batch.append((writer, piece.starts_document, piece.text))
            chars += len(piece.text)
        if chars >= BATCH_CHARS:
            flush()
    flush()
    return documents


def encode_in_memory(
    pieces: Iterable[formats.Piece], tokenizer: Tokenizer, source: str, vocab_size: int
) -> TokenData:
    """Documents tokenized into memory (a text source loaded for training), by the same
    writer as `prepare_corpus`."""
    tokens, index = io.BytesIO(), io.BytesIO()
    dtype = token_dtype_for(tokenizer.vocab_size)
    writer = SplitWriter(tokenizer, dtype, tokens, index)
    write_pieces(pieces, tokenizer, lambda _: writer)
    writer.close()
    if writer.n_tokens == 0:
        raise DataError(f"data source {source} holds no text (every document is empty)")
    return TokenData(
        np.frombuffer(tokens.getbuffer(), dtype=writer.dtype),
        vocab_size,
        source,
        byte_level=tokenizer.kind == BYTES,
        doc_starts=np.frombuffer(index.getbuffer(), dtype=INDEX_DTYPE),
        eot_id=tokenizer.eot_id,
    )
