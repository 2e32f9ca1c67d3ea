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
    with pytest.raises(DataError, match=r"id 300 at position 1 is outside the vocabulary 0..255"):
        TOK.decode([65, 300])
    with pytest.raises(DataError, match=r"id -1 at position 0"):
        TOK.decode(np.array([-1, 2]))


def test_encode_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="str or bytes"):
        TOK.encode(123)  # type: ignore[arg-type]


# --- Hugging Face tokenizers: a byte-level BPE trained here, on text the test makes --------

from bdh_train.data.tokenizer import (  # noqa: E402
    EOT_TOKEN,
    MAX_BPE_VOCAB,
    HFTokenizer,
    load_tokenizer,
    train_bpe,
)

_CORPUS = [f"line {i}: the quick brown fox, ünïcödé 日本 {i * i}\n" for i in range(200)]


def _bpe(vocab_size: int = 400) -> HFTokenizer:
    return train_bpe(_CORPUS, vocab_size)


def test_bpe_round_trips_text_exactly_and_counts_bytes() -> None:
    tok = _bpe()
    assert tok.vocab_size == 400 and tok.eot_id is not None
    text = "Unseen words ÷ ∑ 🐉, tabs\tand  double  spaces\n\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    lengths = tok.token_byte_lengths()
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[tok.eot_id] == 0
    first = tok.decode_bytes(tok.encode("日")[:1])  # part of one character: byte-exact
    assert "日".encode().startswith(first) and len(first) < 3


def test_bpe_training_is_deterministic_and_survives_save_and_load(tmp_path) -> None:
    tok = _bpe()
    assert _bpe().fingerprint() == tok.fingerprint()
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)  # a directory holding tokenizer.json
    assert loaded.fingerprint() == tok.fingerprint()
    assert loaded.encode(_CORPUS[3]) == tok.encode(_CORPUS[3])
    assert loaded.eot_id == tok.eot_id == loaded._tok.token_to_id(EOT_TOKEN)


def test_load_tokenizer_errors_are_one_clear_line(tmp_path) -> None:
    assert load_tokenizer("bytes").vocab_size == 256
    with pytest.raises(DataError, match="not found: data.tokenizer is 'bytes' or the path"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(bad)
    with pytest.raises(DataError, match="outside the vocabulary 0..399"):
        _bpe().decode([400])
    for size in (256, MAX_BPE_VOCAB + 1):
        with pytest.raises(DataError) as refused:
            train_bpe(_CORPUS, size)
        assert str(refused.value) == (
            f"a byte-level BPE needs a vocab_size (--vocab-size) from 257 (256 bytes + "
            f"{EOT_TOKEN}) to 1,048,576, got {size}"
        )


def test_a_rewritten_tokenizer_file_is_read_again(tmp_path) -> None:
    first = _bpe()
    first.save(tmp_path)
    assert load_tokenizer(tmp_path) is load_tokenizer(tmp_path / "tokenizer.json")  # one parse
    second = _bpe(300)
    second.save(tmp_path)
    assert load_tokenizer(tmp_path).fingerprint() == second.fingerprint() != first.fingerprint()
