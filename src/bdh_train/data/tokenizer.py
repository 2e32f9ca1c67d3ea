"""Byte-level tokenizer: every byte is a token, so any text (or binary) round-trips exactly
and no vocabulary file is needed."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from bdh_train.errors import DataError

TokenIds = Iterable[int] | np.ndarray | torch.Tensor
"""What decode accepts: a list of ints, a 1-D numpy array or a 1-D tensor."""


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0..255) and back.

    Stateless; an instance exists so callers can swap in another tokenizer with the same
    `vocab_size` / `encode` / `decode` interface.
    """

    vocab_size: int = 256

    def encode(self, text: str | bytes) -> list[int]:
        """Token ids of `text` (UTF-8 encoded when it is a str)."""
        return list(_to_bytes(text))

    def decode_bytes(self, ids: TokenIds) -> bytes:
        """The exact bytes the ids stand for; ids outside 0..255 raise DataError."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if arr.size == 0:
            return b""
        arr = arr.reshape(-1)
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"ByteTokenizer.decode needs integer ids, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr > 255))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"ByteTokenizer.decode: id {int(arr[i])} at position {i} is outside the byte "
                f"vocabulary 0..255 (was the model trained with vocab_size > 256?)"
            )
        return arr.astype(np.uint8).tobytes()

    def decode(self, ids: TokenIds) -> str:
        """Text of the ids; bytes that are not valid UTF-8 (e.g. a sample cut mid-character)
        become U+FFFD instead of raising."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _to_bytes(text: str | bytes) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"ByteTokenizer.encode needs str or bytes, got {type(text).__name__}")
