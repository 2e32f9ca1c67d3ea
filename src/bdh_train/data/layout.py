"""The prepared corpus's layout, one home for it: what `bdh-train prepare` writes
(`prepared.prepare_corpus`) and training reads (`prepared.load_prepared`).

Layout of DIR:

- `train.bin`, `val.bin` (optional): token ids, headerless, uint16 when the vocabulary has at
  most 65536 ids, else uint32 (`tokens.token_dtype_for`);
- `train.idx.npy`, `val.idx.npy`: each split's document start offsets (uint64, sorted, the
  first 0), memory-mapped when loaded;
- `meta.json`: format name and version, dtype, vocab_size, eot_id, the tokenizer ("bytes" or
  "tokenizer.json") and its sha256 (`Tokenizer.fingerprint()`), per split the token,
  document and text byte counts, and how validation was chosen;
- `tokenizer.json`: the tokenizer, unless it is the byte tokenizer.

How documents become the token stream of a split (separators, document starts, text
bytes): `encode`. The checks of meta.json's fields: `prepared.read_meta`.

Validation (`val_fraction` F): document i > 0 goes to validation when a keyed hash of i is
below F (so about F of the documents, spread over the corpus, the same ones every time;
decided while streaming, so `--train-tokenizer` trains on the training documents only). The
first document always trains. When the hash picks no document, validation is instead the
last F of the training tokens, the cut `TokenData.split` makes (`validation_cut`) - then a
trained tokenizer has seen that text.
Explicit `val_sources` replace the fraction.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from bdh_train.data.tokens import header_path, read_json_file
from bdh_train.errors import DataError

FORMAT_NAME = "bdh-train prepared corpus"
FORMAT_VERSION = 1
META_FILE = "meta.json"
"""The meta file of a prepared corpus directory."""
SPLITS = ("train", "val")
INDEX_DTYPE = np.dtype("<u8")
_VAL_HASH_KEY = b"bdh-train validation documents"


def tokens_file(split: str) -> str:
    return f"{split}.bin"


def index_file(split: str) -> str:
    return f"{split}.idx.npy"


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a prepared corpus directory, whole or damaged: its meta.json parses
    as JSON naming `FORMAT_NAME` (any version; `read_meta` checks the rest), or it holds the
    training split's two files (`train.bin` and `train.idx.npy`, a pair only `prepare`
    writes) whatever its meta.json is (missing, unreadable, not JSON: `read_meta` says so, and
    that the corpus must be prepared again). A directory that merely holds some other
    meta.json is not one."""
    directory = Path(path)
    if all((directory / name).is_file() for name in (tokens_file("train"), index_file("train"))):
        return True
    meta = directory / META_FILE
    if not meta.is_file():
        return False
    try:
        parsed = read_json_file(meta, f"'{meta}'", "not a prepared corpus")
    except DataError:  # unreadable, too large or not JSON: not a prepared corpus
        return False
    return isinstance(parsed, dict) and parsed.get("format") == FORMAT_NAME


def prepared_directory(path: Path) -> Path | None:
    """The prepared corpus a source names: the directory itself, or the one a split file of
    it (`DIR/val.bin`) sits in; None for any other source."""
    if path.is_dir() and is_prepared(path):
        return path
    return path.parent if is_prepared_split(path) else None


def is_prepared_split(path: Path) -> bool:
    """Whether token file `path` is a split of the prepared corpus it sits in (`DIR/val.bin`
    without a `.json` header of its own)."""
    return (
        path.suffix == ".bin"
        and path.stem in SPLITS
        and not header_path(path).exists()
        and is_prepared(path.parent)
    )


def in_validation(index: int, val_fraction: float) -> bool:
    """Whether document `index` goes to validation under `val_fraction` (never the first)."""
    if index == 0 or val_fraction <= 0:
        return False
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8, key=_VAL_HASH_KEY).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64
