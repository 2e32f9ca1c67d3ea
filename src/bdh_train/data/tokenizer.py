"""Tokenizers: the byte tokenizer (every byte is a token, no file needed) and Hugging Face
`tokenizers` models loaded from a `tokenizer.json`, behind one interface.

`load_tokenizer("bytes" | path)` gives either; `train_bpe` trains a byte-level BPE with the
same library. Every tokenizer can say how many UTF-8 bytes each of its ids decodes to
(`token_byte_lengths`), which is what turns a loss per token into bits per byte, and writes
itself into a directory (`save`) so a run carries the tokenizer it was trained with.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bdh_train.data.formats import CUT_ANYWHERE, CUT_AT_WHITESPACE
from bdh_train.errors import DataError
from bdh_train.storage.places import BYTES, TOKENIZER_FILE
from bdh_train.utils import atomic_write, read_regular_file

TokenIds = Iterable[int] | np.ndarray | torch.Tensor
"""What decode accepts: a list of ints, a 1-D numpy array or a 1-D tensor."""

EOT_TOKEN = "<|endoftext|>"
"""The end-of-document token `train_bpe` adds."""
EOT_NAMES = (EOT_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[EOS]")
"""Special tokens a loaded tokenizer's end-of-document token is recognised by, first match."""
TOKENIZER_MAX_BYTES = 1 << 28
"""The largest tokenizer.json read (256 MiB): the largest in common use have about 35 MB
(vocabularies of 256k ids with their merges)."""


class Tokenizer(Protocol):
    """What the trainer, `generate`, `eval` and `prepare` need of a tokenizer."""

    kind: str
    """"bytes" or "huggingface"."""
    vocab_size: int
    eot_id: int | None
    """The end-of-document token's id, or None when the vocabulary has none."""

    def encode(self, text: str | bytes) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode_bytes(self, ids: TokenIds) -> bytes: ...

    def decode(self, ids: TokenIds) -> str: ...

    def token_byte_lengths(self) -> np.ndarray:
        """[vocab_size] int64: the UTF-8 bytes each id decodes to (0 for special tokens)."""
        ...

    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer's description: equal fingerprints encode alike."""
        ...

    def save(self, directory: str | os.PathLike[str]) -> Path | None:
        """Write the tokenizer's file into `directory` (atomically); None when it has none."""
        ...


def _as_id_array(ids: TokenIds, who: str) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    arr = arr.reshape(-1)
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{who}.decode needs integer ids, got dtype {arr.dtype}")
    return arr


def _check_range(arr: np.ndarray, vocab_size: int, who: str) -> None:
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"{who}.decode: id {int(arr[i])} at position {i} is outside the vocabulary "
            f"0..{vocab_size - 1} (was the model trained with another tokenizer?)"
        )


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0..255) and back. Stateless; no end-of-document id."""

    kind = BYTES
    vocab_size: int = 256
    eot_id: int | None = None

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of `text` (UTF-8 encoded when it is a str)."""
        return list(_to_bytes(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode_bytes(self, ids: TokenIds) -> bytes:
        """The exact bytes the ids stand for; ids outside 0..255 raise DataError."""
        arr = _as_id_array(ids, "ByteTokenizer")
        _check_range(arr, 256, "ByteTokenizer")
        return arr.astype(np.uint8).tobytes()

    def decode(self, ids: TokenIds) -> str:
        """Text of the ids; bytes that are not valid UTF-8 (e.g. a sample cut mid-character)
        become U+FFFD instead of raising."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def fingerprint(self) -> str:
        return hashlib.sha256(b"bdh-train byte tokenizer").hexdigest()

    def save(self, directory: str | os.PathLike[str]) -> Path | None:
        return None


@cache
def byte_level_alphabet() -> tuple[str, ...]:
    """The byte-level BPE alphabet: the printable character each byte value 0..255 is
    written as inside a token (printable Latin-1 bytes stand for themselves, the other 68 are
    shifted to code points from 256 on)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return tuple(chr(chars[b]) for b in range(256))


@cache
def _byte_level_decoding() -> dict[str, int]:
    """`byte_level_alphabet` inverted: character -> byte."""
    return {c: b for b, c in enumerate(byte_level_alphabet())}


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (from a `tokenizer.json`) behind the bdh-train
    interface. For byte-level models (GPT-2 style BPE) decoding is byte-exact: a token's
    bytes are read from its characters, so a sample cut mid-character still decodes."""

    kind = "huggingface"

    def __init__(self, tokenizer, source: str = "a tokenizer") -> None:
        self._tok = tokenizer
        self.source = source
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.eot_id = next(
            (i for i in map(tokenizer.token_to_id, EOT_NAMES) if i is not None), None
        )
        self._special = {
            int(i) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self._bytes_of = self._byte_table()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """The tokenizer in `path`, a regular file of at most TOKENIZER_MAX_BYTES."""
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        fix = (
            "give a Hugging Face tokenizer.json (e.g. one written by `bdh-train prepare "
            "--train-tokenizer bpe`) or 'bytes'"
        )
        try:
            text = read_regular_file(
                path, TOKENIZER_MAX_BYTES, f"tokenizer '{path}'", DataError, fix
            ).decode("utf-8")
        except OSError as exc:
            raise DataError(f"cannot read tokenizer '{path}': {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"tokenizer '{path}' is not UTF-8 (byte {exc.start}); {fix}") from None
        try:
            return cls(_HF.from_str(text), f"'{path}'")
        except Exception as exc:  # the library raises plain Exception on a malformed file
            raise DataError(f"cannot load tokenizer '{path}': {exc}; {fix}") from None

    @classmethod
    def from_json(cls, text: str, source: str) -> HFTokenizer:
        """A tokenizer from the text of a `tokenizer.json` (e.g. the copy an export carries);
        `source` names where the text came from in errors."""
        from tokenizers import Tokenizer as _HF

        try:
            return cls(_HF.from_str(text), source)
        except Exception as exc:  # the library raises plain Exception on malformed JSON
            raise DataError(f"the tokenizer of {source} is unusable: {exc}") from None

    def _byte_table(self) -> list[bytes] | None:
        """Each id's bytes when every token is written in the byte-level alphabet, else None
        (decoding then goes through the library's decoder)."""
        alphabet = _byte_level_decoding()
        table: list[bytes] = [b""] * self.vocab_size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in self._special:
                continue
            try:
                table[i] = bytes(alphabet[c] for c in token)
            except KeyError:
                return None
        return table

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodings of many texts at once, on the library's thread pool."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode_bytes(self, ids: TokenIds) -> bytes:
        arr = _as_id_array(ids, "tokenizer")
        _check_range(arr, self.vocab_size, "tokenizer")
        if self._bytes_of is not None:
            return b"".join(self._bytes_of[int(i)] for i in arr)
        return self._tok.decode([int(i) for i in arr]).encode("utf-8")

    def decode(self, ids: TokenIds) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        if self._bytes_of is not None:
            return np.array([len(b) for b in self._bytes_of], dtype=np.int64)
        return np.array(
            [
                0 if i in self._special else len(self._tok.decode([i]).encode("utf-8"))
                for i in range(self.vocab_size)
            ],
            dtype=np.int64,
        )

    def to_json(self) -> str:
        return self._tok.to_str()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, directory: str | os.PathLike[str]) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        with atomic_write(path, "w") as fh:
            fh.write(self.to_json())
        return path


def piece_cuts(tokenizer: Tokenizer) -> str | None:
    """Where `tokenizer` lets a long document be cut into pieces that encode, one by one, to
    the ids of the whole (`formats` module docstring): anywhere for the byte tokenizer; at the
    whitespace places for a Hugging Face tokenizer whose only text processing is a GPT-2 style
    ByteLevel pre-tokenizer (regex on, no prefix space, no normalizer) and whose added tokens
    hold no whitespace and strip none (as `train_bpe` makes); None (whole documents) for any
    other, whose ids may depend on where a piece starts or ends."""
    if tokenizer.kind == BYTES:
        return CUT_ANYWHERE
    if not isinstance(tokenizer, HFTokenizer):
        return None
    spec = json.loads(tokenizer.to_json())
    pre = spec.get("pre_tokenizer") or {}
    plain_byte_level = (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("add_prefix_space") is False
        and pre.get("use_regex", True) is True
    )
    added_safe = all(
        not any(c.isspace() for c in added.get("content", " "))
        and not added.get("lstrip")
        and not added.get("rstrip")
        for added in spec.get("added_tokens") or []
    )
    return CUT_AT_WHITESPACE if plain_byte_level and added_safe else None


def load_tokenizer(spec: str | os.PathLike[str]) -> ByteTokenizer | HFTokenizer:
    """ "bytes", a `tokenizer.json`, or a directory holding one (a run, a checkpoint, a
    prepared corpus)."""
    if os.fspath(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.exists():
        raise DataError(
            f"tokenizer '{spec}' not found: data.tokenizer is 'bytes' or the path of a "
            f"Hugging Face {TOKENIZER_FILE} (or a directory holding one)"
        )
    stat = path.stat()
    return _load_tokenizer_file(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _load_tokenizer_file(path: str, mtime_ns: int, size: int) -> HFTokenizer:
    """One parse per version of a tokenizer file: a run's start reads `data.tokenizer` in the
    config layering, in each validation, in the trainer and in the data loading. The file's
    modification time and size are part of the key, so a rewritten file is read again."""
    return HFTokenizer.from_file(path)


MAX_BPE_VOCAB = 1 << 20
"""The largest vocabulary `train_bpe` trains: four times the largest in common use (256k),
and ids far inside uint32, the prepared format's widest dtype. The trainer allocates for every
id up front: 1e11 ids asked for 4.5 TB and aborted the process."""


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    length: int | None = None,
    show_progress: bool = False,
) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` ids (the 256 byte tokens, merges and `EOT_TOKEN`)
    trained on `texts` with the `tokenizers` library. Same texts, same tokenizer."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not 257 <= vocab_size <= MAX_BPE_VOCAB:
        raise DataError(
            f"a byte-level BPE needs a vocab_size (--vocab-size) from 257 (256 bytes + "
            f"{EOT_TOKEN}) to {MAX_BPE_VOCAB:,}, got {vocab_size}"
        )
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_nonempty(texts), trainer, length=length)
    return HFTokenizer(tok, f"a BPE of {vocab_size} trained by bdh-train")


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t)


def _to_bytes(text: str | bytes) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"ByteTokenizer.encode needs str or bytes, got {type(text).__name__}")
