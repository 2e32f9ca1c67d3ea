"""Where training tokens come from: builtin corpora, text files, directories of text files,
pre-tokenized `.bin` files, prepared corpus directories, and generators registered by the
caller (e.g. NCA).

Every source becomes a `TokenData` (`tokens`): one flat 1-D integer array (memory-mapped for
files, so a large corpus is never read into Python lists) plus the vocabulary size its ids
must fit in. Every failure is a DataError whose message names the source and says how to fix
it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np

from bdh_train.data import corpus_files, formats, prepared
from bdh_train.data.encode import encode_in_memory
from bdh_train.data.formats import TEXT_FIELD
from bdh_train.data.layout import is_prepared, is_prepared_split
from bdh_train.data.tokenizer import BYTES, ByteTokenizer, Tokenizer, piece_cuts
from bdh_train.data.tokens import TokenData, file_size, memmap_file, read_token_file
from bdh_train.errors import ConfigError, DataError
from bdh_train.storage.output import write_file
from bdh_train.utils import special_file_kind, suggest

BUILTIN_PREFIX = "builtin:"


def _pydoc_text() -> str:
    """The Python documentation topics shipped with CPython: ~0.45 MB of real English prose
    that is always available offline, so the demo and the tests need no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].rstrip() for key in sorted(topics)) + "\n"


def _shakespeare_text() -> str:
    """Speeches from Shakespeare's plays, each headed by its speaker's name (tinyshakespeare,
    1.1 MB of ASCII): public domain, shipped gzip-compressed in `data/corpora`, whose NOTICE
    gives its source."""
    import gzip
    import importlib.resources

    packed = importlib.resources.files("bdh_train.data") / "corpora" / "shakespeare.txt.gz"
    return gzip.decompress(packed.read_bytes()).decode("utf-8")


BUILTIN_CORPORA: Mapping[str, Callable[[], str]] = MappingProxyType(
    {"pydoc": _pydoc_text, "shakespeare": _shakespeare_text}
)
"""Name -> function returning the corpus text. Read-only: corpora are fixed, not plugins."""


def write_builtin_corpus(name: str, out: str | os.PathLike[str], force: bool = False) -> int:
    """Write builtin corpus `name` to the file `out` as UTF-8 (atomically) and return its
    size in bytes: the text as a file, for tools that read files (`bdh-train corpus`). The
    output policy applies (`storage.output.write_file`): an existing `out` is a DataError
    unless `force`, which replaces only a regular file; nothing is written then."""
    text = builtin_corpus(name).encode("utf-8")
    write_file(Path(out).expanduser(), text, "--out", DataError, force=force)
    return len(text)


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
            "data.source is empty; give 'builtin:shakespeare', a text file, a directory of text "
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
            data = encode_in_memory(
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
    options = dict(tokenizer=tokenizer, bin_dtype=bin_dtype, text_field=text_field)
    path = Path(source).expanduser()
    val: TokenData | None
    if (
        source not in (generators or {})
        and not source.startswith(BUILTIN_PREFIX)
        and is_prepared(path)
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
    if not path.exists():
        hint = ""
        if name in BUILTIN_CORPORA:
            hint = f" (did you mean '{BUILTIN_PREFIX}{name}'?)"
        raise DataError(
            f"data source path '{path}' does not exist{hint}; give a text file, a directory of "
            f"text files, a .bin token file with a .json header, a directory written by "
            f"`bdh-train prepare`, or one of "
            f"{', '.join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_CORPORA))}"
        )
    kind = special_file_kind(path)
    if kind is not None:  # read, a FIFO waits for a writer and a device never ends
        raise DataError(
            f"data source '{path}' is {kind}, not a regular file or directory; give a text "
            "file, a directory of .txt files, a .bin token file or a directory written by "
            "`bdh-train prepare`"
        )
    if is_prepared(path):
        train, _ = prepared.load_prepared(path, vocab_size, tokenizer=tokenizer)
        return train
    if path.suffix == ".bin":
        return _from_bin(path, vocab_size, bin_dtype, tokenizer)
    if path.is_dir() and not corpus_files.is_hf_dataset(path):
        files = corpus_files.corpus_files(path)
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
    return encode_in_memory(pieces, tokenizer, what, vocab_size)


def _is_plain_text(path: Path) -> bool:
    """Read as text by the memory-mapped byte path: not compressed, not a record format."""
    return (
        path.is_file()
        and corpus_files.compression_of(path) is None
        and corpus_files.format_suffix(path)
        not in corpus_files.JSON_LINES_SUFFIXES + corpus_files.PARQUET_SUFFIXES
    )


def _from_text_file(path: Path, vocab_size: int) -> TokenData:
    if file_size(path) == 0:
        raise DataError(f"data file '{path}' is empty; point data.source at a file with text")
    tokens = memmap_file(path, "uint8", "text file")
    corpus_files.check_utf8(path)
    return TokenData(tokens, vocab_size, f"'{path}'", byte_level=True)


def _from_directory(path: Path, files: list[Path], vocab_size: int) -> TokenData:
    """The byte path of a directory of plain text files: each non-empty file a document,
    joined by a newline (the rule `encode.SplitWriter` applies to the byte tokenizer)."""
    nonempty = [p for p in files if file_size(p)]
    if not nonempty:
        raise DataError(f"data directory '{path}': all {len(files)} text files are empty")
    parts: list[np.ndarray] = []
    starts: list[int] = []
    position = 0
    sep = np.frombuffer(b"\n", dtype=np.uint8)
    for i, p in enumerate(nonempty):
        if i:
            parts.append(sep)
            position += 1
        starts.append(position)
        parts.append(memmap_file(p, "uint8", "text file"))
        corpus_files.check_utf8(p)
        position += len(parts[-1])
    return TokenData(
        np.concatenate(parts),
        vocab_size,
        f"'{path}' ({len(files)} text files)",
        byte_level=True,
        doc_starts=np.array(starts, dtype=np.uint64),
    )


def _from_bin(
    path: Path, vocab_size: int, bin_dtype: str | None, tokenizer: Tokenizer
) -> TokenData:
    """A token file: a split of the prepared corpus it sits in, else `read_token_file` (with its
    `<file>.json` header, or headerless with `bin_dtype`)."""
    if is_prepared_split(path):
        return prepared.load_prepared_split(path.parent, path.stem, vocab_size, tokenizer)
    return read_token_file(path, vocab_size, bin_dtype)
