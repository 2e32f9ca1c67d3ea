"""Where training tokens come from: builtin corpora, text files, directories of text files,
pre-tokenized `.bin` files, and generators registered by the caller (e.g. NCA).

Every source becomes a `TokenData`: one flat 1-D integer array (memory-mapped for files, so a
large corpus is never read into Python lists) plus the vocabulary size its ids must fit in.
Every failure is a DataError whose message names the source and says how to fix it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np

from bdh_train import checks
from bdh_train.data import formats
from bdh_train.data.formats import TEXT_FIELD
from bdh_train.data.tokenizer import BYTES, ByteTokenizer, Tokenizer, piece_cuts
from bdh_train.errors import ConfigError, DataError
from bdh_train.utils import atomic_write, suggest

BUILTIN_PREFIX = "builtin:"
VAL_FRACTION = 0.1
"""The default share held out for validation (`data.val_fraction`, `bdh-train prepare`)."""
TOKEN_DTYPES = ("uint16", "uint32")
"""dtypes a `.bin` token file may hold (named in its JSON header)."""
_SCAN_CHUNK = 1 << 22
"""Ids checked per chunk, so validating a huge memmap never materializes it whole."""


def _pydoc_text() -> str:
    """The Python documentation topics shipped with CPython: ~0.45 MB of real English prose
    that is always available offline, so the demo and the tests need no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].rstrip() for key in sorted(topics)) + "\n"


BUILTIN_CORPORA: Mapping[str, Callable[[], str]] = MappingProxyType({"pydoc": _pydoc_text})
"""Name -> function returning the corpus text. Read-only: corpora are fixed, not plugins."""

TokenGenerator = Callable[[int], "TokenData | np.ndarray"]
"""A synthetic source: called with the model's vocab_size, returns the token stream.
Bind its other settings (seed, sizes) with functools.partial before passing it in."""


def builtin_corpus(name: str) -> str:
    """Text of builtin corpus `name`; unknown names raise DataError listing the known ones."""
    try:
        make = BUILTIN_CORPORA[name]
    except KeyError:
        raise DataError(
            f"unknown builtin corpus {name!r}{suggest(name, BUILTIN_CORPORA)}; "
            f"available: {', '.join(sorted(BUILTIN_CORPORA))}"
        ) from None
    return make()


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


def load_tokens(
    source: str | os.PathLike[str],
    vocab_size: int = 256,
    generators: Mapping[str, TokenGenerator] | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    bin_dtype: str | None = None,
    text_field: str = TEXT_FIELD,
) -> TokenData:
    """Resolve `source` to a TokenData whose ids are all < vocab_size.

    source is, checked in this order: a name in `generators` (called with vocab_size);
    "builtin:<name>" (a builtin corpus's text); a directory written by `bdh-train prepare`
    (its training split; `load_splits` also takes its validation split); a `.bin` token file
    (with a `<file>.json` header, inside a prepared directory, or headerless with
    `bin_dtype`); a directory of corpus files or a corpus file (`formats`: .txt, .jsonl/.json,
    .parquet, any of them .gz/.zst; any other file name is UTF-8 text).

    Text is tokenized by `tokenizer` (None: bytes). With bytes, a plain text file is
    memory-mapped as it is and a directory's files are joined by a newline; other formats and
    other tokenizers are tokenized into memory, a document per file, line or row, with
    `doc_starts` (prepare large corpora once with `bdh-train prepare` instead). Byte sources
    give ids 0..255, so they need vocab_size >= 256 unless the text uses fewer byte values.
    """
    name = os.fspath(source)
    if not name:
        raise ConfigError(
            "data.source is empty; give 'builtin:pydoc', a text file, a directory of .txt "
            "files or a .bin token file"
        )
    generators = generators or {}
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if name in generators:
        data = _from_generator(name, generators[name], vocab_size)
    elif name.startswith(BUILTIN_PREFIX):
        corpus = name[len(BUILTIN_PREFIX) :]
        text = builtin_corpus(corpus)
        if tokenizer.kind == BYTES:
            data = TokenData(
                np.frombuffer(text.encode("utf-8"), dtype=np.uint8),
                vocab_size,
                f"'{name}'",
                byte_level=True,
            )
        else:
            from bdh_train.data import prepared

            data = prepared.encode_in_memory(
                formats.document_pieces(text, piece_cuts(tokenizer)),
                tokenizer,
                f"'{name}'",
                vocab_size,
            )
    else:
        data = _from_path(
            Path(name).expanduser(), vocab_size, name, tokenizer, bin_dtype, text_field
        )
    data.check_ids(vocab_size)
    return data


def load_splits(
    source: str,
    vocab_size: int,
    block_size: int,
    val_fraction: float = 0.0,
    generators: Mapping[str, TokenGenerator] | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    bin_dtype: str | None = None,
    val_source: str | None = None,
    text_field: str = TEXT_FIELD,
) -> tuple[TokenData, TokenData | None]:
    """(train, validation), both checked to fit `block_size`: every data problem is reported
    before the first step rather than mid-run.

    Validation is, first that applies: `val_source` (all of `source` trains); the validation
    split of a prepared corpus `source`; the last `val_fraction` of `source`'s tokens
    (`TokenData.split`). So val_fraction is used only when neither of the others exists.
    """
    from bdh_train.data import prepared

    options = dict(tokenizer=tokenizer, bin_dtype=bin_dtype, text_field=text_field)
    path = Path(source).expanduser()
    val: TokenData | None
    if (
        source not in (generators or {})
        and not source.startswith(BUILTIN_PREFIX)
        and prepared.is_prepared(path)
    ):
        if val_source is None:
            train, val = prepared.load_prepared(path, vocab_size, tokenizer=tokenizer)
        else:  # the prepared validation split is not used: not loaded
            train = prepared.load_prepared_split(path, "train", vocab_size, tokenizer)
            val = None
    else:
        train = load_tokens(source, vocab_size, generators, **options)  # type: ignore[arg-type]
        val = None
    if val_source is not None:
        val = load_tokens(val_source, vocab_size, generators, **options)  # type: ignore[arg-type]
    elif val is None:
        train, val = train.split(val_fraction)
    train.validate_for_block(block_size, "training data")
    if val is not None:
        val.validate_for_block(block_size, "validation data")
    return train, val


def _from_generator(name: str, make: TokenGenerator, vocab_size: int) -> TokenData:
    out = make(vocab_size)
    if isinstance(out, TokenData):
        return (
            out if out.vocab_size == vocab_size else TokenData(out.tokens, vocab_size, out.source)
        )
    arr = np.asarray(out)
    if arr.size == 0:
        raise DataError(f"the {name!r} generator returned no tokens")
    return TokenData(arr.reshape(-1), vocab_size, f"generator {name!r}")


def _from_path(
    path: Path,
    vocab_size: int,
    name: str,
    tokenizer: Tokenizer,
    bin_dtype: str | None,
    text_field: str,
) -> TokenData:
    from bdh_train.data import prepared

    if not path.exists():
        hint = ""
        if name in BUILTIN_CORPORA:
            hint = f" (did you mean '{BUILTIN_PREFIX}{name}'?)"
        raise DataError(
            f"data source path '{path}' does not exist{hint}; give a text file, a directory of "
            f".txt files, a .bin token file with a .json header, a directory written by "
            f"`bdh-train prepare`, or one of "
            f"{', '.join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_CORPORA))}"
        )
    if prepared.is_prepared(path):
        train, _ = prepared.load_prepared(path, vocab_size, tokenizer=tokenizer)
        return train
    if path.suffix == ".bin":
        return _from_bin(path, vocab_size, bin_dtype, tokenizer)
    if path.is_dir() and not formats.is_hf_dataset(path):
        files = formats.corpus_files(path)
        if tokenizer.kind == BYTES and all(_is_plain_text(p) for p in files):
            return _from_directory(path, files, vocab_size)
        what = f"'{path}' ({len(files)} files)"
    else:
        files = [path]
        if tokenizer.kind == BYTES and _is_plain_text(path):
            return _from_text_file(path, vocab_size)
        what = f"'{path}'"
    cuts = piece_cuts(tokenizer)
    pieces = (piece for p in files for piece in formats.read_pieces(p, text_field, cuts))
    return prepared.encode_in_memory(pieces, tokenizer, what, vocab_size)


def _is_plain_text(path: Path) -> bool:
    """Read as text by the memory-mapped byte path: not compressed, not a record format."""
    return (
        path.is_file()
        and formats.compression_of(path) is None
        and formats.format_suffix(path)
        not in formats.JSON_LINES_SUFFIXES + formats.PARQUET_SUFFIXES
    )


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read data file '{path}': {exc.strerror or exc}") from exc


def _memmap(path: Path, dtype: str, what: str) -> np.ndarray:
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


def _from_text_file(path: Path, vocab_size: int) -> TokenData:
    if _file_size(path) == 0:
        raise DataError(f"data file '{path}' is empty; point data.source at a file with text")
    tokens = _memmap(path, "uint8", "text file")
    formats.check_utf8(path)
    return TokenData(tokens, vocab_size, f"'{path}'", byte_level=True)


def _from_directory(path: Path, files: list[Path], vocab_size: int) -> TokenData:
    """The byte path of a directory of plain text files: each non-empty file a document,
    joined by a newline (the rule `prepared.SplitWriter` applies to the byte tokenizer)."""
    nonempty = [p for p in files if _file_size(p)]
    if not nonempty:
        raise DataError(f"data directory '{path}': all {len(files)} .txt files are empty")
    parts: list[np.ndarray] = []
    starts: list[int] = []
    position = 0
    sep = np.frombuffer(b"\n", dtype=np.uint8)
    for i, p in enumerate(nonempty):
        if i:
            parts.append(sep)
            position += 1
        starts.append(position)
        parts.append(_memmap(p, "uint8", "text file"))
        formats.check_utf8(p)
        position += len(parts[-1])
    return TokenData(
        np.concatenate(parts),
        vocab_size,
        f"'{path}' ({len(files)} text files)",
        byte_level=True,
        doc_starts=np.array(starts, dtype=np.uint64),
    )


def header_path(path: str | os.PathLike[str]) -> Path:
    """The JSON header that describes token file `path`: `<path>.json`, e.g. `x.bin.json`."""
    p = Path(path)
    return p.with_name(p.name + ".json")


JSON_MAX_BYTES = 1 << 20
"""The largest token header or prepared-corpus meta.json read: both are a few hundred bytes
as written, so a larger one is damaged or not one, and is not read into memory."""


def read_json_file(path: Path, label: str, fix: str) -> object:
    """The JSON value in `path` (at most JSON_MAX_BYTES); every failure is a DataError that
    begins with `label` (how the message names the file) and ends with `fix`."""
    try:
        size = path.stat().st_size
        text = path.read_bytes() if size <= JSON_MAX_BYTES else None
    except OSError as exc:
        raise DataError(f"cannot read {label}: {exc.strerror or exc}") from exc
    if text is None:
        raise DataError(f"{label} has {size} bytes, more than the {JSON_MAX_BYTES} read; {fix}")
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


def is_prepared_split(path: Path) -> bool:
    """Whether token file `path` is a split of the prepared corpus it sits in (`DIR/val.bin`
    without a `.json` header of its own)."""
    from bdh_train.data import prepared

    return (
        path.suffix == ".bin"
        and path.stem in prepared.SPLITS
        and not header_path(path).exists()
        and prepared.is_prepared(path.parent)
    )


def _from_bin(
    path: Path, vocab_size: int, bin_dtype: str | None, tokenizer: Tokenizer
) -> TokenData:
    """A token file: with its `<file>.json` header; a split of the prepared corpus it sits in;
    or headerless (nanoGPT style) with `bin_dtype` (ids checked against vocab_size)."""
    from bdh_train.data import prepared

    if is_prepared_split(path):
        return prepared.load_prepared_split(path.parent, path.stem, vocab_size, tokenizer)
    if header_path(path).exists() or bin_dtype is None:
        header = read_header(path)
        dtype = str(header["dtype"])
        file_vocab = int(header["vocab_size"])  # type: ignore[arg-type]
    else:
        dtype, file_vocab = bin_dtype, vocab_size
    size = _file_size(path)
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"token file '{path}' is empty")
    if size % itemsize:
        raise DataError(
            f"token file '{path}' has {size} bytes, not a multiple of {itemsize} ({dtype}); "
            f"the file is truncated or its dtype (header or data.bin_dtype) is wrong"
        )
    data = TokenData(_memmap(path, dtype, "token file"), vocab_size, f"'{path}'")
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
