"""Token sources: builtin corpus, text files, directories, .bin files, generators, errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from bdh_train.data import (
    ByteTokenizer,
    TokenData,
    builtin_corpus,
    header_path,
    load_splits,
    load_tokens,
    write_token_file,
)
from bdh_train.errors import DataError


def test_builtin_pydoc_is_large_and_deterministic() -> None:
    from pydoc_data.topics import topics

    text = builtin_corpus("pydoc")
    assert len(text.encode("utf-8")) > 300_000
    assert text == builtin_corpus("pydoc")
    first = sorted(topics)[0]
    assert text.startswith(topics[first].rstrip() + "\n\n")


def test_builtin_source_gives_byte_ids() -> None:
    data = load_tokens("builtin:pydoc")
    assert isinstance(data, TokenData) and data.vocab_size == 256
    assert ByteTokenizer().decode(data.tokens[:2000]) == builtin_corpus("pydoc")[:2000]


def test_unknown_builtin_lists_names() -> None:
    with pytest.raises(DataError, match=r"unknown builtin corpus 'pydocs'.*available: pydoc"):
        load_tokens("builtin:pydocs")
    with pytest.raises(DataError, match=r"available: pydoc"):
        builtin_corpus("nope")


def test_text_file_is_memmapped(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("héllo world", encoding="utf-8")
    data = load_tokens(str(path))
    assert isinstance(data.tokens, np.memmap)
    assert data.tokens.tolist() == list("héllo world".encode())


def test_directory_sorted_and_joined(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "ignored.pyc").write_bytes(b"\x00nope")  # binary: not a corpus file
    data = load_tokens(str(tmp_path))
    assert bytes(data.tokens.astype(np.uint8)) == b"first\nsecond"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_file_round_trip(tmp_path: Path, dtype: str) -> None:
    vocab = 80_000 if dtype == "uint32" else 1000
    ids = np.arange(1000) % 700 + (70_000 if dtype == "uint32" else 0)
    path = write_token_file(tmp_path / "t.bin", ids, vocab_size=vocab, dtype=dtype)
    assert json.loads(header_path(path).read_text()) == {"dtype": dtype, "vocab_size": vocab}
    assert path.stat().st_size == ids.size * np.dtype(dtype).itemsize
    data = load_tokens(str(path), vocab_size=vocab)
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.dtype(dtype)
    assert np.array_equal(data.tokens, ids)


def test_write_token_file_default_dtype(tmp_path: Path) -> None:
    write_token_file(tmp_path / "s.bin", [1, 2, 3], vocab_size=65536)
    write_token_file(tmp_path / "l.bin", [1, 2, 3], vocab_size=65537)
    assert json.loads((tmp_path / "s.bin.json").read_text())["dtype"] == "uint16"
    assert json.loads((tmp_path / "l.bin.json").read_text())["dtype"] == "uint32"
    with pytest.raises(DataError, match=r"id 9 at position 2 is outside 0\.\.8"):
        write_token_file(tmp_path / "x.bin", [1, 2, 9], vocab_size=9)


def test_split_is_last_fraction() -> None:
    data = TokenData(np.arange(1000), 1000, "test")
    train, val = data.split(0.1)
    assert val is not None
    assert np.array_equal(train.tokens, np.arange(900))
    assert np.array_equal(val.tokens, np.arange(900, 1000))
    same_train, none = data.split(0)
    assert none is None and same_train is data


def test_load_splits_validates_both_parts(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(b"x" * 1000)
    train, val = load_splits(str(path), 256, block_size=64, val_fraction=0.1)
    assert len(train) == 900 and val is not None and len(val) == 100
    with pytest.raises(
        DataError,
        match=r"validation data .* has 20 tokens, fewer than block_size "
        r"\+ 1 = 65: .*larger data.val_fraction",
    ):
        load_splits(str(path), 256, block_size=64, val_fraction=0.02)


def test_generator_registry() -> None:
    calls: list[int] = []

    def make(vocab_size: int) -> np.ndarray:
        calls.append(vocab_size)
        return np.arange(100) % vocab_size

    data = load_tokens("nca", vocab_size=50, generators={"nca": make})
    assert calls == [50] and len(data) == 100 and data.vocab_size == 50


# ---- errors: each asserts the message names the problem and the fix ----


def test_generated_source_without_its_generator_is_a_missing_path() -> None:
    """Generated sources are resolved by the data config (DataConfig.generators); the plain
    loader given no generator reads the name as a path."""
    with pytest.raises(DataError, match=r"data source path 'nca' does not exist"):
        load_tokens("nca")


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(
        DataError, match=rf"data source path '{re.escape(str(missing))}' does not exist.*builtin:"
    ):
        load_tokens(str(missing))
    with pytest.raises(DataError, match=r"did you mean 'builtin:pydoc'"):
        load_tokens("pydoc")


def test_unreadable_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret.txt"
    path.write_bytes(b"data")
    if os.geteuid() != 0:
        path.chmod(0)
        with pytest.raises(DataError, match=rf"cannot read text file '{re.escape(str(path))}'"):
            load_tokens(str(path))
        path.chmod(0o600)
    # Root reads anything, so also simulate the OS refusing.
    import builtins

    real_open = builtins.open

    def deny(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(
        DataError, match=rf"cannot read text file '{re.escape(str(path))}': Permission denied"
    ):
        load_tokens(str(path))


def test_empty_file_and_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=rf"data file '{re.escape(str(empty))}' is empty"):
        load_tokens(str(empty))
    other = tmp_path / "d"
    other.mkdir()
    (other / "notes.pyc").write_bytes(b"\x00\x01")
    with pytest.raises(
        DataError, match=rf"data directory '{re.escape(str(other))}' contains no corpus files"
    ):
        load_tokens(str(other))
    with pytest.raises(DataError, match=r"all 1 text files are empty"):
        load_tokens(str(tmp_path))


def test_a_directory_of_python_files_is_the_corpus_prepare_reads_from_them(tmp_path: Path):
    """One rule for a corpus file: data.source = DIR reads the .py files that
    `prepare DIR/*.py` names (compiled files beside them skipped), in the same order."""
    from bdh_train.data.prepared import prepare_corpus

    src = tmp_path / "src"
    (src / "__pycache__").mkdir(parents=True)
    (src / "b.py").write_text("def b():\n    return 2\n")
    (src / "a.py").write_text("def a():\n    return 1\n")
    (src / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\x00\x00\x00")
    loaded = load_tokens(str(src))
    assert bytes(loaded.tokens) == b"def a():\n    return 1\n\ndef b():\n    return 2\n"
    quiet = {"progress": False, "val_fraction": 0.0}
    named = prepare_corpus(sorted(src.glob("*.py")), tmp_path / "named", **quiet)
    listed = prepare_corpus([src], tmp_path / "listed", **quiet)
    assert named["splits"] == listed["splits"] and listed["splits"]["train"]["documents"] == 2


def test_too_short_for_block() -> None:
    data = TokenData(np.arange(10), 256, "'tiny'")
    data.validate_for_block(9)
    with pytest.raises(DataError, match=r"'tiny' has 10 tokens, fewer than block_size \+ 1 = 11"):
        data.validate_for_block(10)


def test_ids_outside_vocab(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "t.bin", [1, 2, 700, 5, 900], vocab_size=1000)
    with pytest.raises(
        DataError, match=r"token id 700 at position 2 in .* is >= vocab_size 512: .*at least 901"
    ):
        load_tokens(str(path), vocab_size=512)
    text = tmp_path / "t.txt"
    text.write_text("abé", encoding="utf-8")
    with pytest.raises(DataError, match=r"token id 195 at position 2 .* >= vocab_size 128"):
        load_tokens(str(text), vocab_size=128)


def test_ids_beyond_header_vocab(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.array([1, 300], dtype=np.uint16).tofile(path)
    header_path(path).write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    with pytest.raises(DataError, match=r"id 300 at position 1 .* vocab_size 256 its header"):
        load_tokens(str(path), vocab_size=1024)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, r"has no header '.*t\.bin\.json'; write one containing"),
        ("{not json", r"is not valid JSON"),
        ("[1, 2]", r"must be a JSON object"),
        ('{"vocab_size": 256}', r"has no 'dtype'"),
        ('{"dtype": "int64", "vocab_size": 256}', r"unsupported dtype 'int64'; supported: uint16"),
        (
            '{"dtype": "uint16"}',
            r"needs a positive integer 'vocab_size' whose ids fit uint16, "
            r"got None",
        ),
        (
            '{"dtype": "uint16", "vocab_size": "256"}',
            r"'vocab_size' whose ids fit uint16, "
            r"got '256'",
        ),
        ('{"dtype": "uint16", "vocab_size": 65537}', r"whose ids fit uint16, got 65537"),
        (
            '{"dtype": "uint32", "vocab_size": ' + "9" * 5000 + "}",
            r"is not valid JSON \(Exceeds the limit \(4300 digits\)",
        ),
        ("[" * 100_000 + "]" * 100_000, r"is not valid JSON \(maximum recursion depth"),
        (
            " " * (1 << 20) + '{"dtype": "uint16", "vocab_size": 256}',
            r"t\.bin\.json' has 1048614 bytes, more than the 1 MiB \(1048576 bytes\) read; "
            r"expected",
        ),
    ],
)
def test_bad_headers(tmp_path: Path, header: str | None, message: str) -> None:
    path = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    if header is not None:
        header_path(path).write_text(header)
    with pytest.raises(DataError, match=message):
        load_tokens(str(path))


def test_bin_size_not_multiple_of_dtype(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(b"\x01\x00\x02")
    header_path(path).write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    with pytest.raises(DataError, match=r"has 3 bytes, not a multiple of 2 \(uint16\)"):
        load_tokens(str(path))
    path.write_bytes(b"")
    with pytest.raises(DataError, match=r"token file '.*' is empty"):
        load_tokens(str(path))


def test_unsupported_write_dtype(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"unsupported token dtype 'int8'"):
        write_token_file(tmp_path / "t.bin", [1], vocab_size=10, dtype="int8")
    with pytest.raises(DataError, match=r"vocab_size 70000 does not fit in uint16"):
        write_token_file(tmp_path / "t.bin", [1], vocab_size=70_000, dtype="uint16")
