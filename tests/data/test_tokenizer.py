"""ByteTokenizer: exact round trips, lenient text decoding, strict id checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bdh_train.data import ByteTokenizer
from bdh_train.errors import DataError

TOK = ByteTokenizer()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_bytes_round_trip(data: bytes) -> None:
    ids = TOK.encode(data)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode_bytes(ids) == data
    assert TOK.decode_bytes(np.frombuffer(data, dtype=np.uint8)) == data
    assert TOK.decode_bytes(torch.tensor(ids, dtype=torch.long)) == data


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_text_round_trip(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


def test_encode_is_utf8_bytes() -> None:
    assert TOK.vocab_size == 256
    assert TOK.encode("hé") == [104, 0xC3, 0xA9]
    assert TOK.encode(b"ab") == [97, 98]


def test_decode_replaces_invalid_utf8() -> None:
    # A sample cut mid-character must still print.
    assert TOK.decode([104, 0xC3]) == "h\ufffd"
    assert TOK.decode([]) == ""


def test_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(DataError, match=r"id 300 at position 1 is outside the byte vocabulary"):
        TOK.decode([65, 300])
    with pytest.raises(DataError, match=r"id -1 at position 0"):
        TOK.decode(np.array([-1, 2]))


def test_encode_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="str or bytes"):
        TOK.encode(123)  # type: ignore[arg-type]
