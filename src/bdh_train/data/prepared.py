"""The prepared corpus: documents tokenized once by `bdh-train prepare` into a directory that
training memory-maps. This module writes it (`prepare_corpus`) and reads it (`load_prepared`,
`read_meta`: the checks of meta.json); its layout, what is one (`is_prepared`) and which
documents are validation: `layout`; how documents become a split's token stream: `encode`.

When the validation hash picks no document, validation is the last `val_fraction` of the
training tokens, cut from train.bin after writing (`validation_cut`, the cut `TokenData.split`
makes).

The writer streams: pieces of documents are tokenized in batches (`encode_batch`, on the
tokenizer's thread pool) and appended to the files, into a temporary sibling directory that
is renamed into place at the end (a failure leaves nothing). The writer holds a `flock` on
its temporary, which the kernel drops when the writer dies, so the next prepare of the same
output removes the temporary a killed one left (`remove_abandoned_temporaries`) and never
one whose writer still runs. Same inputs, same bytes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from bdh_train import checks
from bdh_train.data import corpus_files, formats
from bdh_train.data.encode import SplitWriter, write_pieces
from bdh_train.data.layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DTYPE,
    META_FILE,
    SPLITS,
    in_validation,
    index_file,
    is_prepared,
    tokens_file,
)
from bdh_train.data.tokenizer import (
    BYTES,
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    piece_cuts,
    train_bpe,
)
from bdh_train.data.tokens import (
    TOKEN_DTYPES,
    VAL_FRACTION,
    TokenData,
    read_json_file,
    split_doc_starts,
    token_dtype_for,
    validation_cut,
    vocab_fits,
)
from bdh_train.errors import DataError
from bdh_train.storage.output import check_output, clean_leftovers, publish_dir

_COPY_TOKENS = 1 << 22


def layout_names() -> frozenset[str]:
    """The names a prepared corpus directory holds (and nothing else)."""
    return frozenset(
        [META_FILE, TOKENIZER_FILE]
        + [name for split in SPLITS for name in (tokens_file(split), index_file(split))]
    )


# --------------------------------------------------------------------------------- writing
@dataclass
class _Split:
    name: str
    writer: SplitWriter
    tokens: BinaryIO
    index: BinaryIO


def _open_split(directory: Path, name: str, tokenizer: Tokenizer, dtype: str) -> _Split:
    tokens = open(directory / tokens_file(name), "wb")  # noqa: SIM115 - closed by _finish
    index = open(directory / f"{name}.idx.raw", "wb")  # noqa: SIM115
    return _Split(name, SplitWriter(tokenizer, dtype, tokens, index), tokens, index)


def _finish_split(directory: Path, split: _Split) -> dict[str, int] | None:
    """Close the split's files and turn its raw index into the .npy; None (files removed)
    when it got no tokens."""
    split.writer.close()
    for handle in (split.tokens, split.index):  # put on disk by `publish_dir`
        handle.close()
    raw = directory / f"{split.name}.idx.raw"
    if split.writer.n_tokens == 0:
        raw.unlink()
        (directory / tokens_file(split.name)).unlink()
        return None
    starts = np.memmap(raw, dtype=INDEX_DTYPE, mode="r")
    _write_index(directory / index_file(split.name), starts)
    del starts
    raw.unlink()
    w = split.writer
    return {"tokens": w.n_tokens, "documents": w.n_documents, "text_bytes": w.text_bytes}


def _write_index(path: Path, starts: np.ndarray) -> None:
    out = np.lib.format.open_memmap(path, mode="w+", dtype=INDEX_DTYPE, shape=(len(starts),))
    for s in range(0, len(starts), _COPY_TOKENS):
        out[s : s + _COPY_TOKENS] = starts[s : s + _COPY_TOKENS]
    out.flush()
    del out


def _text_bytes(tokens: np.ndarray, lengths: np.ndarray) -> int:
    return sum(
        int(lengths[np.asarray(tokens[s : s + _COPY_TOKENS])].sum())
        for s in range(0, len(tokens), _COPY_TOKENS)
    )


def _cut_tail(
    directory: Path,
    counts: dict[str, int],
    val_fraction: float,
    tokenizer: Tokenizer,
    dtype: str,
) -> tuple[dict[str, int], dict[str, int]]:
    """Move the last `val_fraction` of train.bin into val.bin (the `TokenData.split` cut)."""
    n = counts["tokens"]
    cut = validation_cut(n, val_fraction, f"the prepared corpus ({n} tokens)")
    train_bin = directory / tokens_file("train")
    tokens = np.memmap(train_bin, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    starts = np.load(directory / index_file("train"), mmap_mode="r")
    train_starts, val_starts = split_doc_starts(np.asarray(starts), cut)
    lengths = tokenizer.token_byte_lengths()
    with open(directory / tokens_file("val"), "wb") as out:
        for s in range(cut, n, _COPY_TOKENS):
            out.write(np.asarray(tokens[s : min(s + _COPY_TOKENS, n)]).tobytes())
    val_bytes = _text_bytes(tokens[cut:], lengths)
    del tokens, starts
    with open(train_bin, "r+b") as fh:
        fh.truncate(cut * np.dtype(dtype).itemsize)
    _write_index(directory / index_file("train"), train_starts)
    _write_index(directory / index_file("val"), val_starts)
    train = {
        "tokens": cut,
        "documents": len(train_starts),
        "text_bytes": counts["text_bytes"] - val_bytes,
    }
    val = {"tokens": n - cut, "documents": len(val_starts), "text_bytes": val_bytes}
    return train, val


def _check_output(out: Path, force: bool) -> None:
    """`out` under the output policy (storage.output): new, or with `force` a prepared corpus
    or an empty directory (`_check_replaceable`)."""
    check_output(out, "output", DataError, force=force, directory=True, same_kind=_replaceable)


def _replaceable(out: Path) -> None:
    """Refuse an existing directory that is neither a prepared corpus nor empty."""
    names = {entry.name for entry in out.iterdir()}
    if not names:
        return
    foreign = sorted(names - layout_names())
    if is_prepared(out) and not foreign:
        return
    why = (
        f"it also holds {', '.join(map(repr, foreign[:3]))}"
        if is_prepared(out) and foreign
        else f"its {META_FILE} is not a {FORMAT_NAME}'s"
        if META_FILE in names
        else f"no {META_FILE}"
    )
    raise DataError(
        f"output '{out}' exists and is not a prepared corpus ({why}); --force replaces only a "
        f"prepared corpus or an empty directory: remove it yourself or choose another --out"
    )


class _Progress:
    """The tqdm bar on stderr: source bytes read (with rate and ETA) and, when `tokens`,
    tokens written."""

    def __init__(
        self, total: int | None, enabled: bool, desc: str = "prepare", tokens: bool = True
    ) -> None:
        from tqdm import tqdm

        self.tokens, self.show_tokens = 0, tokens
        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=not enabled,
            desc=desc,
            dynamic_ncols=True,
        )

    def __call__(self, source_bytes: int, tokens: int) -> None:
        self.tokens += tokens
        if self.show_tokens:
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        self.bar.update(source_bytes)

    def close(self) -> None:
        self.bar.close()


def prepare_corpus(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    train_bpe_vocab: int | None = None,
    val_fraction: float = VAL_FRACTION,
    val_sources: Sequence[str | os.PathLike[str]] | None = None,
    text_field: str = formats.TEXT_FIELD,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize the documents of `sources` into the prepared corpus `out`; returns its meta.

    tokenizer: the tokenizer to use (None: bytes); or train_bpe_vocab: train a byte-level BPE
    of that many ids on the training documents and store it in `out`. Validation: the
    documents `val_fraction` picks (module docstring), or the documents of `val_sources`.
    An existing `out` is refused unless `force` (then only a prepared corpus or an empty
    directory is replaced). Every failure raises before `out` is touched.
    """
    out = Path(out)
    if not sources:
        raise DataError("prepare needs at least one source")
    checks.number("val_fraction", val_fraction, low=0.0, high=1.0)
    if tokenizer is not None and train_bpe_vocab is not None:
        raise DataError("give a tokenizer or a BPE vocabulary size to train, not both")
    _check_output(out, force)
    files = corpus_files.expand_sources(list(sources))
    val_files = corpus_files.expand_sources(list(val_sources)) if val_sources else []
    fraction = 0.0 if val_sources else float(val_fraction)
    totals = [corpus_files.source_bytes(files), corpus_files.source_bytes(val_files)]
    total = None if None in totals else sum(t for t in totals if t is not None)

    def write(tmp: Path) -> None:
        nonlocal tokenizer
        if train_bpe_vocab is not None:  # one bar of ours, not the tokenizers library's stages
            bar = _Progress(corpus_files.source_bytes(files), progress, "train BPE", tokens=False)
            try:
                tokenizer = train_bpe(
                    _training_texts(files, text_field, fraction, bar), train_bpe_vocab
                )
            finally:
                bar.close()
        tokenizer = tokenizer or ByteTokenizer()
        meta.update(
            _write_corpus(
                tmp,
                files,
                val_files,
                tokenizer,
                fraction,
                text_field,
                total,
                progress,
            )
        )
        meta["sources"] = [os.fspath(s) for s in sources]
        meta["val_sources"] = [os.fspath(s) for s in val_sources or []]
        if tokenizer.save(tmp) is not None:
            meta["tokenizer"] = TOKENIZER_FILE
        with open(tmp / META_FILE, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=2, sort_keys=True)
            fh.write("\n")

    meta: dict[str, Any] = {}
    publish_dir(
        out,
        write,
        "output",
        "prepare",
        DataError,
        force=force,
        same_kind=_replaceable,
        ours=_holds_only_prepare_files,
    )
    return meta


def _holds_only_prepare_files(directory: Path) -> bool:
    """Whether every entry of `directory` is a regular file named as `prepare_corpus` names
    what it writes into its temporary (a file of someone else's is never removed)."""
    names = layout_names() | {f"{split}.idx.raw" for split in SPLITS}
    with os.scandir(directory) as entries:
        for entry in entries:
            written = entry.name in names or (
                entry.name.startswith(f".{TOKENIZER_FILE}.") and entry.name.endswith(".tmp")
            )  # atomic_write's temporary of tokenizer.json
            if not written or not entry.is_file(follow_symlinks=False):
                return False
    return True


def remove_abandoned_temporaries(out: str | os.PathLike[str]) -> list[Path]:
    """Remove what earlier `prepare_corpus` calls for `out` left beside it when they were
    killed, and return it (`storage.output.clean_leftovers`): a temporary whose writer still
    runs is kept (its writer holds a `flock` on it), and so is one holding a name
    `prepare_corpus` does not write."""
    return clean_leftovers(out, _holds_only_prepare_files)


def _training_texts(
    files: list[Path], text_field: str, val_fraction: float, progress: _Progress
) -> Iterator[str]:
    """The text pieces of the training documents (those `in_validation` leaves out), cut
    only where `train_bpe`'s pre-tokenizer has a boundary, so it counts the same words; the
    source bytes read go to `progress`."""
    index, keep = -1, True
    for path in files:
        for piece in formats.read_pieces(path, text_field, formats.CUT_AT_WHITESPACE):
            progress(piece.source_bytes, 0)
            if piece.starts_document:
                index += 1
                keep = not in_validation(index, val_fraction)
            if keep and piece.text:
                yield piece.text


def _write_corpus(
    tmp: Path,
    files: list[Path],
    val_files: list[Path],
    tokenizer: Tokenizer,
    val_fraction: float,
    text_field: str,
    total: int | None,
    progress: bool,
) -> dict[str, Any]:
    dtype = token_dtype_for(tokenizer.vocab_size)
    train = _open_split(tmp, "train", tokenizer, dtype)
    val = _open_split(tmp, "val", tokenizer, dtype)
    bar = _Progress(total, progress)
    try:
        cuts = piece_cuts(tokenizer)

        def pieces(paths: list[Path]) -> Iterator[formats.Piece]:
            for path in paths:
                yield from formats.read_pieces(path, text_field, cuts)

        write_pieces(
            pieces(files),
            tokenizer,
            lambda i: val.writer if in_validation(i, val_fraction) else train.writer,
            bar,
        )
        if val_files:
            write_pieces(pieces(val_files), tokenizer, lambda _: val.writer, bar)
    finally:
        bar.close()
    train_counts = _finish_split(tmp, train)
    val_counts = _finish_split(tmp, val)
    if train_counts is None:
        raise DataError(f"the sources hold no text ({len(files)} file(s), every document empty)")
    rule = "sources" if val_files else "documents" if val_fraction > 0 else "none"
    if val_files and val_counts is None:
        raise DataError("the validation sources hold no text (every document empty)")
    if val_fraction > 0 and val_counts is None:
        train_counts, val_counts = _cut_tail(tmp, train_counts, val_fraction, tokenizer, dtype)
        rule = "tail"
    splits = {"train": train_counts}
    if val_counts is not None:
        splits["val"] = val_counts
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": int(tokenizer.vocab_size),
        "eot_id": tokenizer.eot_id,
        "tokenizer": BYTES,
        "tokenizer_sha256": tokenizer.fingerprint(),
        "text_field": text_field,
        "val_rule": rule,
        "val_fraction": val_fraction,
        "splits": splits,
    }


# --------------------------------------------------------------------------------- reading
def read_meta(directory: Path) -> dict[str, Any]:
    """The checked meta.json of a prepared corpus (sizes not yet compared with the files)."""
    path = directory / META_FILE
    redo = f"prepare the corpus again with `bdh-train prepare ... --out {directory} --force`"
    meta = read_json_file(path, f"'{path}'", redo)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataError(f"'{path}' is not the meta of a {FORMAT_NAME}; {redo}")
    if meta.get("version") != FORMAT_VERSION:
        raise DataError(
            f"'{path}' has format version {meta.get('version')!r}, this bdh-train reads "
            f"version {FORMAT_VERSION}; {redo}"
        )

    def bad(what: str) -> DataError:
        return DataError(f"'{path}': {what}; the file is damaged, {redo}")

    if meta.get("dtype") not in TOKEN_DTYPES:
        raise bad(f"dtype {meta.get('dtype')!r} is not one of {', '.join(TOKEN_DTYPES)}")
    vocab = meta.get("vocab_size")
    if not vocab_fits(vocab, meta["dtype"]):
        raise bad(f"vocab_size {vocab!r} is not a positive integer that fits {meta['dtype']}")
    eot = meta.get("eot_id")
    if eot is not None and (not checks.is_int(eot) or not 0 <= eot < vocab):
        raise bad(f"eot_id {eot!r} is outside the vocabulary")
    if meta.get("tokenizer") not in (BYTES, TOKENIZER_FILE) or not isinstance(
        meta.get("tokenizer_sha256"), str
    ):
        raise bad("'tokenizer' must be 'bytes' or 'tokenizer.json', with a 'tokenizer_sha256'")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or "train" not in splits or set(splits) - set(SPLITS):
        raise bad(f"'splits' must hold 'train' (and optionally 'val'), got {splits!r}")
    for name, counts in splits.items():
        if (
            not isinstance(counts, dict)
            or not all(
                checks.is_int(counts.get(k)) and counts[k] >= 0
                for k in ("tokens", "documents", "text_bytes")
            )
            or counts["tokens"] == 0
            or not 0 < counts["documents"] <= counts["tokens"]
        ):
            raise bad(f"split {name!r} needs positive token and document counts, got {counts!r}")
    return meta


def corpus_tokenizer(directory: Path) -> Path | None:
    """The tokenizer.json a prepared corpus was tokenized with; None for the byte tokenizer."""
    meta = read_meta(directory)
    return None if meta["tokenizer"] == BYTES else directory / TOKENIZER_FILE


def _check_tokenizer(directory: Path, meta: dict[str, Any], tokenizer: Tokenizer) -> None:
    if tokenizer.fingerprint() == meta["tokenizer_sha256"]:
        return
    theirs = (
        "the byte tokenizer" if meta["tokenizer"] == BYTES else f"'{directory / TOKENIZER_FILE}'"
    )
    fix = "'bytes'" if meta["tokenizer"] == BYTES else f"'{directory}'"
    raise DataError(
        f"prepared corpus '{directory}' was tokenized with {theirs} (sha256 "
        f"{meta['tokenizer_sha256'][:12]}...), not with data.tokenizer "
        f"({getattr(tokenizer, 'source', tokenizer.kind)}, sha256 "
        f"{tokenizer.fingerprint()[:12]}...): set data.tokenizer = {fix}, or leave "
        "data.tokenizer out (a prepared corpus brings its own)"
    )


def _load_split(
    directory: Path, meta: dict[str, Any], split: str, vocab_size: int, tokenizer: Tokenizer
) -> TokenData:
    counts = meta["splits"][split]
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    redo = f"prepare the corpus again (`bdh-train prepare ... --out {directory} --force`)"
    bin_path, idx_path = directory / tokens_file(split), directory / index_file(split)
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise DataError(f"prepared corpus '{directory}' lacks {path.name}; {redo}")
    size = bin_path.stat().st_size
    if size != counts["tokens"] * dtype.itemsize:
        raise DataError(
            f"'{bin_path}' has {size} bytes, but {META_FILE} says {counts['tokens']} "
            f"{meta['dtype']} tokens ({counts['tokens'] * dtype.itemsize} bytes); {redo}"
        )
    with open(idx_path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, idx_dtype = read_header(fh)
        except ValueError as exc:
            raise DataError(f"'{idx_path}' is not a .npy document index ({exc}); {redo}") from None
        offset = fh.tell()
    n_docs = counts["documents"]
    if idx_dtype != INDEX_DTYPE or shape != (n_docs,) or fortran:
        raise DataError(
            f"'{idx_path}' holds {idx_dtype} {shape}, but {META_FILE} says {n_docs} uint64 "
            f"document starts; {redo}"
        )
    if idx_path.stat().st_size != offset + n_docs * INDEX_DTYPE.itemsize:
        raise DataError(f"'{idx_path}' is truncated or has extra bytes; {redo}")
    starts = np.memmap(idx_path, dtype=INDEX_DTYPE, mode="r", offset=offset, shape=(n_docs,))
    _check_starts(starts, counts["tokens"], idx_path, redo)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    return TokenData(
        tokens,
        vocab_size,
        f"'{directory}' ({'validation' if split == 'val' else split} split)",
        byte_level=tokenizer.kind == BYTES,
        doc_starts=starts,
        eot_id=meta["eot_id"],
    )


def _check_starts(starts: np.ndarray, n_tokens: int, path: Path, redo: str) -> None:
    if int(starts[0]) != 0 or int(starts[-1]) >= n_tokens:
        raise DataError(
            f"'{path}': document starts must begin at 0 and stay below {n_tokens}; {redo}"
        )
    previous = -1
    for s in range(0, len(starts), _COPY_TOKENS):
        chunk = np.asarray(starts[s : s + _COPY_TOKENS]).astype(np.int64)
        if chunk[0] <= previous or (chunk.size > 1 and np.any(np.diff(chunk) <= 0)):
            raise DataError(f"'{path}': document starts are not increasing; {redo}")
        previous = int(chunk[-1])


def load_prepared(
    directory: str | os.PathLike[str],
    vocab_size: int | None = None,
    *,
    tokenizer: Tokenizer | None = None,
) -> tuple[TokenData, TokenData | None]:
    """(train, validation or None) of a prepared corpus, memory-mapped, with document starts
    and the end-of-document id. `tokenizer` (None: bytes) must be the one the corpus was
    prepared with; ids must be below `vocab_size` (default: the corpus's). Every size in
    meta.json is compared with the files before anything is mapped."""
    meta = read_meta(Path(directory))
    train = load_prepared_split(directory, "train", vocab_size, tokenizer)
    val = None
    if "val" in meta["splits"]:
        val = load_prepared_split(directory, "val", vocab_size, tokenizer)
    return train, val


def load_prepared_split(
    directory: str | os.PathLike[str],
    split: str,
    vocab_size: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> TokenData:
    """One split of a prepared corpus (`DIR/val.bin` named as a source reads this), checked
    like `load_prepared`."""
    directory = Path(directory)
    meta = read_meta(directory)
    if split not in meta["splits"]:
        raise DataError(
            f"prepared corpus '{directory}' has no {split} split (it has "
            f"{', '.join(meta['splits'])})"
        )
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    _check_tokenizer(directory, meta, tokenizer)
    vocab = int(meta["vocab_size"]) if vocab_size is None else int(vocab_size)
    data = _load_split(directory, meta, split, vocab, tokenizer)
    data.check_ids(vocab)
    return data
