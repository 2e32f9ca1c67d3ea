"""Documents read from text corpora, streamed: the reading side of `bdh-train prepare` and
of loading text sources with a tokenizer.

Formats (by file name; each may also end in `.gz` or `.zst`, decompressed on the fly; a
compressed parquet file into a temporary file, as parquet needs random access):

- `.txt` and any other name not listed below: UTF-8 text, one file = one document;
- `.jsonl`, `.json`: JSON lines, one object per line = one document, its text in the field
  `text_field` (default "text"); blank lines are skipped;
- `.parquet`: one row = one document, the string column `text_field` (read one record batch
  at a time);
- a directory saved by Hugging Face `datasets` (`save_to_disk`): one row = one document
  (needs the `datasets` package);
- any other directory: its corpus files and those of its subdirectories, in sorted order
  (`corpus_files.list_files`: which files are a corpus, how they are opened and
  decompressed, and the streamed UTF-8 check that refuses a binary file with one DataError
  naming it).

Empty documents are skipped.

A document is yielded as pieces (`Piece`) when the tokenizer allows it (`cuts`), so memory
stays bounded however long a document is:

- `CUT_ANYWHERE` (the byte tokenizer, whose ids do not depend on context): pieces of about
  `PIECE_CHARS` characters, cut preferably as below, else anywhere;
- `CUT_AT_WHITESPACE` (a byte-level BPE whose pre-tokenizer splits at whitespace, GPT-2
  style, without a prefix space or normalizer, as `train_bpe` makes): pieces of about
  `PIECE_CHARS` characters cut only where that pre-tokenizer has a token boundary whatever
  comes before or after, so encoding the pieces one by one gives the ids of encoding the
  whole document: right after a newline standing alone between two visible characters
  ("a\nb", not "a\n\nb" nor "a \nb"), between the "\r" and "\n" of such a CRLF line
  end, or where there is none, right before a space between two visible characters (a text
  file, streamed, looks for one after `MAX_PIECE_CHARS` characters without a line end, and
  is refused with a DataError when that span has no space either).
- None (any other tokenizer): whole documents, never cut (memory grows with the longest).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bdh_train.data.corpus_files import (
    JSON_LINES_SUFFIXES,
    PARQUET_SUFFIXES,
    binary_file_error,
    contextlib_decompressed,
    expand_sources,
    format_suffix,
    iter_utf8,
    open_binary,
)
from bdh_train.errors import DataError

TEXT_FIELD = "text"
"""The default field (JSON lines) or column (parquet, datasets) that holds a document."""
PIECE_CHARS = 1 << 20
"""About how many characters a long document's pieces hold."""
MAX_PIECE_CHARS = 8 * PIECE_CHARS
"""A text file's piece without a newline cut grows to this before a space cut is taken."""
CUT_ANYWHERE = "anywhere"
CUT_AT_WHITESPACE = "whitespace"
"""Where a tokenizer lets documents be cut into pieces (module docstring); None: nowhere."""
PARQUET_BATCH_ROWS = 1024
FIELD_HINT = "name the field that holds the text with --text-field / data.text_field"
_VISIBLE = re.compile(r"[!-~\w]")
"""A visible character (ASCII or word characters, whitespace in no definition): on both
sides of a cut."""


@dataclass(frozen=True)
class Piece:
    """Text of one document, or of part of one."""

    text: str
    starts_document: bool
    """True for a document's first piece."""
    source_bytes: int
    """Bytes of the source files read since the previous piece (for progress)."""


# ---------------------------------------------------------------------------- documents
def _visible(text: str, i: int) -> bool:
    return 0 <= i < len(text) and _VISIBLE.match(text, i) is not None


def newline_cut(text: str, lo: int, hi: int) -> int | None:
    """The last place in (lo, hi] to cut `text` at a line end (module docstring): after a
    lone "\n" or between the "\r" and "\n" of a lone CRLF, between visible characters."""
    end = min(hi, len(text) - 2) + 1  # a newline needs a character after it
    while (p := text.rfind("\n", lo, end)) >= 0:
        if _visible(text, p + 1):
            if p < hi and _visible(text, p - 1):
                return p + 1
            if p > lo and text[p - 1] == "\r" and _visible(text, p - 2):
                return p
        end = p
    return None


def space_cut(text: str, lo: int, hi: int) -> int | None:
    """The last place in (lo, hi] to cut `text`: right before a space between two visible
    characters."""
    end = min(hi, len(text) - 2) + 1
    while (p := text.rfind(" ", lo + 1, end)) >= 0:
        if _visible(text, p - 1) and _visible(text, p + 1):
            return p
        end = p
    return None


def split_text(text: str, cuts: str | None, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of about `piece_chars` characters where `cuts` allows (module
    docstring): at line ends, else before a space, else (`CUT_ANYWHERE`) anywhere; one piece
    when `cuts` is None or there is no such place."""
    if cuts is None or len(text) <= piece_chars:
        return [text]
    pieces: list[str] = []
    start = 0
    while len(text) - start > piece_chars:
        target = start + piece_chars
        cut = newline_cut(text, start, target)
        if cut is None:
            cut = space_cut(text, start, target)
        if cut is None and cuts == CUT_ANYWHERE:
            cut = target
        if cut is None:  # none up to the target: the first line end after it
            cut = _first_newline_cut(text, target)
            if cut is None:
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _first_newline_cut(text: str, start: int) -> int | None:
    p = start
    while (p := text.find("\n", p)) >= 0:
        cut = newline_cut(text, max(p - 1, 0), p + 1)
        if cut is not None and cut > start:
            return cut
        p += 1
    return None


def document_pieces(text: str, cuts: str | None, consumed: int = 0) -> Iterator[Piece]:
    """One document given as a string, as pieces (`split_text`)."""
    for i, part in enumerate(split_text(text, cuts)):
        yield Piece(part, i == 0, consumed if i == 0 else 0)


def _text_file(path: Path, cuts: str | None) -> Iterator[Piece]:
    """One document: the file's text, streamed in pieces where `cuts` allows. Each read is
    searched once for a line-end cut (with the three characters before it); a piece is
    joined only when it is given out."""
    parts: list[str] = []
    size = 0  # characters in `parts`
    latest: int | None = None  # the last line-end cut found in `parts`
    tail = ""  # the last three characters of `parts`
    first = True
    pending = 0
    for chunk, consumed in iter_utf8(path):
        pending += consumed
        if not chunk:
            continue
        if cuts is not None:
            window = tail + chunk
            found = newline_cut(window, 0, len(window))
            if found is not None and size - len(tail) + found > 0:
                latest = max(latest or 0, size - len(tail) + found)
            tail = window[-3:]
        parts.append(chunk)
        size += len(chunk)
        if cuts is None or size < PIECE_CHARS:
            continue
        cut = latest
        if cut is None and size >= MAX_PIECE_CHARS:
            buffer = "".join(parts)
            parts = [buffer]
            cut = space_cut(buffer, 0, size)
            if cut is None and cuts == CUT_ANYWHERE:
                cut = size
            if cut is None:
                raise DataError(
                    f"'{path}' has {size:,} characters without a newline or a space between "
                    f"visible characters, where the tokenizer's text may be cut: split the "
                    f"text into lines or documents (.jsonl), or use the byte tokenizer"
                )
        if cut is None or cut == 0:
            continue
        buffer = "".join(parts)
        yield Piece(buffer[:cut], first, pending)
        rest = buffer[cut:]
        parts, size, latest, first, pending = [rest] if rest else [], len(rest), None, False, 0
    if parts:
        yield Piece("".join(parts), first, pending)
    elif pending and not first:
        yield Piece("", False, pending)


def _json_lines(path: Path, text_field: str, cuts: str | None) -> Iterator[Piece]:
    with open_binary(path) as (stream, counter):
        seen = 0
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"line {number} of '{path}'"
            try:
                record = json.loads(line)
            except UnicodeDecodeError as exc:
                raise binary_file_error(
                    path, f"invalid UTF-8 on line {number}: {exc.reason}"
                ) from None
            except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError;
                # a number of over 4300 digits is one too, and nesting too deep recurses
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise DataError(
                    f"{where} is not JSON ({why}): .jsonl/.json files are read as JSON "
                    f"lines, one object per line with the text in field '{text_field}'"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f"{where} has no field '{text_field}' (it has {keys}); {FIELD_HINT}"
                )
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{where}: field '{text_field}' is a {type(text).__name__}, not a string"
                )
            if "\x00" in text:
                raise binary_file_error(path, f"NUL character on line {number}")
            if not text.isascii():  # json.loads reads escaped and raw lone surrogates
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise binary_file_error(
                        path, f"a lone surrogate in field '{text_field}' on line {number}"
                    ) from None
            consumed, seen = counter.consumed - seen, counter.consumed
            if text:
                yield from document_pieces(text, cuts, consumed)
        if counter.consumed > seen:
            yield Piece("", False, counter.consumed - seen)


def _string_column(batch: Any, text_field: str, path: Path) -> list[str | None]:
    """The texts of a batch's string column, checked as a text file's are (UTF-8, no NUL)."""
    import pyarrow as pa

    where = f"parquet file '{path}'"
    names = batch.schema.names
    if text_field not in names:
        raise DataError(f"{where} has no column '{text_field}' (it has {names}); {FIELD_HINT}")
    column = batch.column(names.index(text_field))
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{where}: column '{text_field}' is {column.type}, not a string column")
    try:
        texts = column.to_pylist()
    except UnicodeDecodeError as exc:  # arrow strings are not validated when written
        raise binary_file_error(
            path, f"invalid UTF-8 in column '{text_field}': {exc.reason}"
        ) from None
    if any("\x00" in text for text in texts if text):
        raise binary_file_error(path, f"NUL character in column '{text_field}'")
    return texts


def _parquet(path: Path, text_field: str, cuts: str | None) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with contextlib_decompressed(path) as local:
        try:
            reader = pq.ParquetFile(local)
            size = path.stat().st_size
            groups = reader.metadata.num_row_groups
            columns = [text_field] if text_field in reader.schema_arrow.names else None
            reported = 0
            for group in range(groups):
                for batch in reader.iter_batches(
                    batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns
                ):
                    for text in _string_column(batch, text_field, path):
                        if text:
                            yield from document_pieces(text, cuts)
                done = size * (group + 1) // groups
                yield Piece("", False, done - reported)
                reported = done
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"cannot read parquet file '{path}': {exc}") from None


def _hf_dataset(path: Path, text_field: str, cuts: str | None) -> Iterator[Piece]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"'{path}' is a saved Hugging Face dataset: reading it needs the `datasets` package "
            f"(pip install datasets), or export it to .jsonl or .parquet first"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # the library raises several kinds for a damaged directory
        raise DataError(f"cannot load saved dataset '{path}': {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"saved dataset '{path}' has splits {sorted(loaded)} and no 'train': give the "
                f"directory of one split"
            )
        loaded = loaded["train"]
    if text_field not in loaded.column_names:
        raise DataError(
            f"saved dataset '{path}' has no column '{text_field}' (it has "
            f"{loaded.column_names}); {FIELD_HINT}"
        )
    for rows in loaded.select_columns([text_field]).iter(batch_size=PARQUET_BATCH_ROWS):
        for text in rows[text_field]:
            if not isinstance(text, str | None):
                raise DataError(
                    f"saved dataset '{path}': column '{text_field}' holds "
                    f"{type(text).__name__}, not strings"
                )
            if text:
                yield from document_pieces(text, cuts)


def read_pieces(path: Path, text_field: str, cuts: str | None) -> Iterator[Piece]:
    """The documents of one file (or saved dataset), as pieces cut where `cuts` allows (a
    tokenizer's `piece_cuts`)."""
    if path.is_dir():
        return _hf_dataset(path, text_field, cuts)
    suffix = format_suffix(path)
    if suffix in JSON_LINES_SUFFIXES:
        return _json_lines(path, text_field, cuts)
    if suffix in PARQUET_SUFFIXES:
        return _parquet(path, text_field, cuts)
    return _text_file(path, cuts)


def iter_documents(
    sources: list[str | os.PathLike[str]], text_field: str = TEXT_FIELD
) -> Iterator[str]:
    """The documents of every source in order, whole (for tests and small corpora; use
    `read_pieces` to stay within bounded memory)."""
    parts: list[str] = []
    for path in expand_sources(sources):
        for piece in read_pieces(path, text_field, CUT_ANYWHERE):
            if piece.starts_document and parts:
                yield "".join(parts)
                parts = []
            if piece.text:
                parts.append(piece.text)
    if parts:
        yield "".join(parts)
