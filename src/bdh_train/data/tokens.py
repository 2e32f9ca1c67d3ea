"""A stream of token ids (`TokenData`) and the files that hold one.

`TokenData` is one flat 1-D integer array (memory-mapped for files, so a large corpus is never
read into Python lists) plus the vocabulary size its ids must fit in; the validation cut every
split makes (`validation_cut`); `.bin` token files and their JSON headers (`write_token_file`,
`read_token_file`, `read_header`); the bounded JSON read shared with the prepared corpus's
meta.json (`read_json_file`). Every failure is a DataError whose message names the file or
source and says how to fix it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import numpy as np

from bdh_train import checks
from bdh_train.errors import DataError
from bdh_train.utils import atomic_write, read_regular_file

VAL_FRACTION = 0.1
"""The default share held out for validation (`data.val_fraction`, `bdh-train prepare`)."""
TOKEN_DTYPES = ("uint16", "uint32")
"""dtypes a `.bin` token file may hold (named in its JSON header)."""
_SCAN_CHUNK = 1 << 22
"""Ids checked per chunk, so validating a huge memmap never materializes it whole."""


@dataclass(frozen=True)
class TokenData:
    """A flat stream of token ids and the vocabulary they belong to.

    tokens: 1-D integer array; a numpy.memmap when it came from a file (slices stay memmaps).
    vocab_size: every id is < vocab_size (checked by load_tokens).
    source: human-readable origin, used in error messages.
    byte_level: the ids are the UTF-8 bytes of text, so a loss per token is a loss per byte
        (bits per byte is reported for such data only).
    doc_starts: sorted start offsets of the documents in `tokens` (the first is 0), or None
        when the stream is not cut into documents.
    eot_id: the end-of-document token id of the tokenizer that wrote `tokens`, or None.
    """

    tokens: np.ndarray
    vocab_size: int
    source: str
    byte_level: bool = False
    doc_starts: np.ndarray | None = None
    eot_id: int | None = None

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise DataError(
                f"token data from {self.source} must be a 1-D integer array, got shape "
                f"{tuple(self.tokens.shape)} dtype {self.tokens.dtype}"
            )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def split(self, val_fraction: float) -> tuple[TokenData, TokenData | None]:
        """(train, validation): validation is the LAST `val_fraction` of the stream.

        Deterministic and contiguous, so no window straddles the two sets except at the one
        boundary; val_fraction 0 gives no validation set. A positive fraction always yields at
        least one token; whether that is enough is `validate_for_block`'s call.
        """
        if val_fraction == 0:
            return self, None
        cut = validation_cut(len(self), val_fraction, self.source)
        train_starts = val_starts = None
        if self.doc_starts is not None:
            train_starts, val_starts = split_doc_starts(self.doc_starts, cut)
        train = replace(
            self,
            tokens=self.tokens[:cut],
            source=f"{self.source} (train split)",
            doc_starts=train_starts,
        )
        val = replace(
            self,
            tokens=self.tokens[cut:],
            source=f"{self.source} (validation split)",
            doc_starts=val_starts,
        )
        return train, val

    def validate_for_block(self, block_size: int, what: str = "data") -> None:
        """Raise DataError unless at least one window of block_size + 1 tokens fits."""
        need = int(block_size) + 1
        if len(self) < need:
            raise DataError(
                f"{what} from {self.source} has {len(self)} tokens, fewer than "
                f"block_size + 1 = {need}: use a longer source, a smaller block_size"
                + (" or a larger data.val_fraction" if "validation" in what else "")
            )

    def check_ids(self, vocab_size: int | None = None) -> None:
        """Raise DataError naming the first id >= vocab_size (default: self.vocab_size) and its
        position. Scans in chunks so a memmap is never loaded whole."""
        limit = self.vocab_size if vocab_size is None else int(vocab_size)
        pos = first_id_at_least(self.tokens, limit)
        if pos is None:
            return
        bad = int(self.tokens[pos])
        if bad < 0:
            raise DataError(f"token id {bad} at position {pos} in {self.source} is negative")
        raise DataError(
            f"token id {bad} at position {pos} in {self.source} is >= vocab_size {limit}: "
            f"raise model.vocab_size to at least {_max_id(self) + 1} or re-tokenize the data"
        )


def validation_cut(n_tokens: int, val_fraction: float, source: str) -> int:
    """Where a stream of `n_tokens` splits into training and its last `val_fraction` (at least
    one token each): the cut `TokenData.split` and `bdh-train prepare` make."""
    n_val = min(max(1, int(round(n_tokens * float(val_fraction)))), n_tokens - 1)
    if n_val <= 0:
        raise DataError(
            f"{source} has {n_tokens} token(s), too few to split off a validation set; "
            f"use more data or set data.val_fraction = 0"
        )
    return n_tokens - n_val


def split_doc_starts(starts: np.ndarray, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """Document starts of the two sides of a stream cut at `cut`: the starts before it, and
    those from it on shifted by -cut, beginning with 0 (the cut document's rest)."""
    starts = np.asarray(starts)
    before = np.asarray(starts[starts < cut])
    after = np.asarray(starts[starts >= cut], dtype=starts.dtype) - starts.dtype.type(cut)
    if after.size == 0 or after[0] != 0:
        after = np.concatenate([np.zeros(1, dtype=starts.dtype), after])
    return before, after


def token_dtype_for(vocab_size: int) -> str:
    """The smallest of `TOKEN_DTYPES` that holds ids 0..vocab_size-1."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def first_id_at_least(tokens: np.ndarray, limit: int) -> int | None:
    """Position of the first element >= limit (or < 0), or None; chunked for memmaps."""
    if np.issubdtype(tokens.dtype, np.unsignedinteger) and limit > np.iinfo(tokens.dtype).max:
        return None
    for start in range(0, tokens.shape[0], _SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + _SCAN_CHUNK])
        bad = np.flatnonzero((chunk >= limit) | (chunk < 0))
        if bad.size:
            return start + int(bad[0])
    return None


def _max_id(data: TokenData) -> int:
    return max(
        int(np.asarray(data.tokens[s : s + _SCAN_CHUNK]).max())
        for s in range(0, len(data), _SCAN_CHUNK)
    )


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read data file '{path}': {exc.strerror or exc}") from exc


def memmap_file(path: Path, dtype: str, what: str) -> np.ndarray:
    """Read-only memmap of `path`, turning OS errors into one clear DataError."""
    try:
        with open(path, "rb"):  # permission problems surface here with a plain strerror
            pass
        return np.memmap(path, dtype=np.dtype(dtype), mode="r")
    except OSError as exc:
        raise DataError(
            f"cannot read {what} '{path}': {exc.strerror or exc}; check that it is a readable "
            f"regular file"
        ) from exc


def header_path(path: str | os.PathLike[str]) -> Path:
    """The JSON header that describes token file `path`: `<path>.json`, e.g. `x.bin.json`."""
    p = Path(path)
    return p.with_name(p.name + ".json")


JSON_MAX_BYTES = 1 << 20
"""The largest token header or prepared-corpus meta.json read: both are a few hundred bytes
as written, so a larger one is damaged or not one, and is not read into memory."""


def read_json_file(path: Path, label: str, fix: str) -> object:
    """The JSON value in regular file `path` of at most JSON_MAX_BYTES
    (`utils.read_regular_file`); every failure is a DataError that names the file as `label`
    and ends with `fix`."""
    try:
        text = read_regular_file(path, JSON_MAX_BYTES, label, DataError, fix)
    except OSError as exc:
        raise DataError(f"cannot read {label}: {exc.strerror or exc}; {fix}") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, too many digits or levels
        raise DataError(f"{label} is not valid JSON ({exc}); {fix}") from exc


def vocab_fits(vocab: object, dtype: str) -> bool:
    """Whether `vocab` is a positive vocabulary size whose ids all fit `dtype`."""
    return checks.is_int(vocab) and 0 < vocab <= np.iinfo(dtype).max + 1  # type: ignore[operator]


def read_header(path: Path) -> dict[str, object]:
    """Parse and check a token file's header; every defect is a DataError that says what the
    header must look like."""
    hpath = header_path(path)
    expected = '{"dtype": "uint16" or "uint32", "vocab_size": <int>}'
    if not hpath.exists():
        raise DataError(
            f"token file '{path}' has no header '{hpath}'; write one containing {expected} "
            f"(bdh_train.data.write_token_file does this), or for a headerless (nanoGPT) file "
            f"set data.bin_dtype to its id dtype (uint16 or uint32)"
        )
    header = read_json_file(hpath, f"token header '{hpath}'", f"expected {expected}")
    if not isinstance(header, dict):
        raise DataError(f"token header '{hpath}' must be a JSON object like {expected}")
    dtype = header.get("dtype")
    if dtype is None:
        raise DataError(f"token header '{hpath}' has no 'dtype'; expected {expected}")
    if dtype not in TOKEN_DTYPES:
        raise DataError(
            f"token header '{hpath}' has unsupported dtype {dtype!r}; supported: "
            f"{', '.join(TOKEN_DTYPES)}"
        )
    vocab = header.get("vocab_size")
    if not vocab_fits(vocab, dtype):
        raise DataError(
            f"token header '{hpath}' needs a positive integer 'vocab_size' whose ids fit "
            f"{dtype}, got {vocab!r}"
        )
    return header


def read_token_file(path: Path, vocab_size: int, bin_dtype: str | None = None) -> TokenData:
    """A `.bin` token file, memory-mapped: with its `<file>.json` header, or headerless
    (nanoGPT style) with `bin_dtype` (ids checked against vocab_size)."""
    if header_path(path).exists() or bin_dtype is None:
        header = read_header(path)
        dtype = str(header["dtype"])
        file_vocab = int(cast(int, header["vocab_size"]))  # read_header checked it
    else:
        dtype, file_vocab = bin_dtype, vocab_size
    size = file_size(path)
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"token file '{path}' is empty")
    if size % itemsize:
        raise DataError(
            f"token file '{path}' has {size} bytes, not a multiple of {itemsize} ({dtype}); "
            f"the file is truncated or its dtype (header or data.bin_dtype) is wrong"
        )
    data = TokenData(memmap_file(path, dtype, "token file"), vocab_size, f"'{path}'")
    if file_vocab < vocab_size:
        pos = first_id_at_least(data.tokens, file_vocab)
        if pos is not None:
            raise DataError(
                f"token id {int(data.tokens[pos])} at position {pos} in '{path}' is >= the "
                f"vocab_size {file_vocab} its header declares; the file or header is corrupt"
            )
    return data


def write_token_file(
    path: str | os.PathLike[str],
    ids: Sequence[int] | np.ndarray,
    vocab_size: int,
    dtype: str | None = None,
) -> Path:
    """Write ids as a `.bin` token file plus its `<path>.json` header (both atomically).

    dtype defaults to uint16 when vocab_size fits in it, else uint32. Ids are checked against
    vocab_size first, so a written file always loads.
    """
    if dtype is None:
        dtype = token_dtype_for(vocab_size)
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"unsupported token dtype {dtype!r}; supported: {', '.join(TOKEN_DTYPES)}")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(f"vocab_size {vocab_size} does not fit in {dtype}; use uint32")
    arr = np.asarray(ids).reshape(-1)
    if arr.size == 0:
        raise DataError(f"write_token_file('{path}'): no ids to write")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"write_token_file('{path}'): ids must be integers, got {arr.dtype}")
    pos = first_id_at_least(arr, vocab_size)
    if pos is not None:
        raise DataError(
            f"write_token_file('{path}'): id {int(arr[pos])} at position {pos} is outside "
            f"0..{vocab_size - 1}"
        )
    path = Path(path)
    with atomic_write(path, "wb") as fh:
        fh.write(arr.astype(dtype).tobytes())
    with atomic_write(header_path(path), "w") as fh:
        json.dump({"dtype": dtype, "vocab_size": int(vocab_size)}, fh)
        fh.write("\n")
    return path
