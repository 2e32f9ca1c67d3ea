"""Files a user names are read only when they are regular files, and whole only up to a size
limit the error states (`utils.read_regular_file`): a config file or one it extends, a
tokenizer, a prepared corpus's meta.json, a token header. /dev/zero (endless) and a FIFO (a
read waits for a writer) are refused at once with one error line, without filling memory:
each such test runs under `bounded_memory` (conftest.py) and a timeout."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
import pytest

from bdh_train.cli import main
from bdh_train.config import load_config
from bdh_train.config.layering import CONFIG_MAX_BYTES
from bdh_train.data import load_tokens
from bdh_train.data import tokenizer as tokenizer_module
from bdh_train.data.layout import META_FILE
from bdh_train.data.prepared import read_meta
from bdh_train.data.tokenizer import load_tokenizer, train_bpe
from bdh_train.errors import ConfigError, DataError
from bdh_train.utils import read_lines, read_regular_file, size_text

ZERO = Path("/dev/zero")
QUICK_S = 5.0
"""A refusal takes well under this (a read of /dev/zero fills gigabytes in that time)."""


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    """A FIFO nothing writes to: a plain open() of it for reading waits forever."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _one_error_line(capsys, argv: list[str]) -> str:
    """The error line `bdh-train ARGV` prints (exit 2, nothing on stdout), quickly."""
    capsys.readouterr()
    started = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - started < QUICK_S
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    return err.removeprefix("error: ").rstrip("\n")


def test_size_text_names_the_largest_unit_that_divides():
    assert [size_text(n) for n in (1 << 20, 16 << 20, 1 << 30, 3 << 10, 1000)] == [
        "1 MiB (1048576 bytes)",
        "16 MiB (16777216 bytes)",
        "1 GiB (1073741824 bytes)",
        "3 KiB (3072 bytes)",
        "1000 bytes",
    ]


@pytest.mark.timeout(30)
def test_read_regular_file_refuses_devices_fifos_directories_and_large_files(
    tmp_path: Path, fifo: Path, bounded_memory
):
    small = tmp_path / "small"
    small.write_bytes(b"0123456789")
    assert read_regular_file(small, 10, "small", DataError) == b"0123456789"
    for path, kind in (
        (ZERO, "a character device"),
        (fifo, "a FIFO (named pipe)"),
        (tmp_path, "a directory"),
    ):
        with pytest.raises(DataError) as refused:
            read_regular_file(path, 10, f"file {path.name}", DataError)
        assert str(refused.value) == (
            f"file {path.name} is {kind}, not a regular file; give the path of a file"
        )
    with pytest.raises(ConfigError) as refused:
        read_regular_file(small, 9, "small", ConfigError, "keep it short")
    assert str(refused.value) == "small has 10 bytes, more than the 9 bytes read; keep it short"
    with pytest.raises(FileNotFoundError):  # the caller words it
        read_regular_file(tmp_path / "none", 9, "none", DataError)


@pytest.mark.timeout(30)
def test_read_lines_refuses_a_line_over_the_limit_after_reading_that_much(bounded_memory):
    lines = io.BytesIO(b"ab\n\ncdef\nlast")
    assert list(read_lines(lines, 5, "f", DataError)) == [
        (1, b"ab\n"),
        (2, b"\n"),
        (3, b"cdef\n"),
        (4, b"last"),
    ]
    with pytest.raises(DataError) as refused:
        list(read_lines(io.BytesIO(b"ab\ncdefg\n"), 5, "f", DataError))
    assert str(refused.value) == "f:2: the line is longer than 5 bytes, the most a line may hold"
    with open(ZERO, "rb") as endless, pytest.raises(DataError) as refused:
        list(read_lines(endless, 1 << 20, "/dev/zero", DataError))
    assert str(refused.value).startswith(
        "/dev/zero:1: the line is longer than 1 MiB (1048576 bytes)"
    )
    assert endless.closed


@pytest.mark.timeout(30)
def test_a_config_extending_dev_zero_or_a_fifo_is_refused_at_once(
    tmp_path: Path, fifo: Path, capsys, bounded_memory
):
    for target, kind in ((ZERO, "a character device"), (fifo, "a FIFO (named pipe)")):
        config = tmp_path / "run.toml"
        config.write_text(f'extends = ["{target}"]\n')
        assert _one_error_line(capsys, ["config", "--config", str(config)]) == (
            f"config file {target} (extended by {config.resolve()}) is {kind}, not a regular "
            "file; give the path of a TOML config file"
        )
    assert _one_error_line(capsys, ["config", "--config", str(fifo)]) == (
        f"config file {fifo} is a FIFO (named pipe), not a regular file; give the path of a "
        "TOML config file"
    )
    assert _one_error_line(capsys, ["config", "--config", str(tmp_path)]) == (
        f"config file {tmp_path} is a directory, not a regular file; give the path of a TOML "
        "config file"
    )


def test_a_config_file_over_the_limit_is_refused_with_the_limit(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text("# a comment\n" * (CONFIG_MAX_BYTES // 12 + 1))
    size = big.stat().st_size
    (tmp_path / "run.toml").write_text('extends = ["big.toml"]\n')
    with pytest.raises(ConfigError) as refused:
        load_config([tmp_path / "run.toml"])
    assert str(refused.value) == (
        f"config file {big} (extended by {(tmp_path / 'run.toml').resolve()}) has {size} "
        "bytes, more than the 1 MiB (1048576 bytes) read; give the path of a TOML config file"
    )
    body = "[model]\nn_layer = 3\n"
    big.write_text("#" * (CONFIG_MAX_BYTES - len(body) - 1) + "\n" + body)
    assert big.stat().st_size == CONFIG_MAX_BYTES
    assert load_config([tmp_path / "run.toml"]).model.n_layer == 3  # at the limit: read


@pytest.mark.timeout(30)
def test_a_tokenizer_that_is_dev_zero_or_a_fifo_is_refused_at_once(
    tmp_path: Path, fifo: Path, capsys, bounded_memory
):
    fix = (
        "give a Hugging Face tokenizer.json (e.g. one written by `bdh-train prepare "
        "--train-tokenizer bpe`) or 'bytes'"
    )
    for target, kind in ((ZERO, "a character device"), (fifo, "a FIFO (named pipe)")):
        argv = ["config", "--set", f"data.tokenizer={target}"]
        assert _one_error_line(capsys, argv) == (
            f"tokenizer '{target}' is {kind}, not a regular file; {fix}"
        )


def test_a_tokenizer_over_the_limit_is_refused_with_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = train_bpe(["some text to learn from"] * 4, 260).save(tmp_path)
    size = path.stat().st_size
    monkeypatch.setattr(tokenizer_module, "TOKENIZER_MAX_BYTES", size - 1)
    with pytest.raises(DataError) as refused:
        load_tokenizer(path)
    assert str(refused.value).startswith(
        f"tokenizer '{path}' has {size} bytes, more than the {size - 1} bytes read; give a "
    )
    monkeypatch.setattr(tokenizer_module, "TOKENIZER_MAX_BYTES", size)
    assert load_tokenizer(path).vocab_size == 260


@pytest.mark.timeout(30)
def test_a_meta_json_or_token_header_that_is_dev_zero_is_refused_at_once(
    tmp_path: Path, bounded_memory
):
    (tmp_path / META_FILE).symlink_to(ZERO)
    started = time.monotonic()
    with pytest.raises(DataError) as refused:
        read_meta(tmp_path)
    assert str(refused.value) == (
        f"'{tmp_path / META_FILE}' is a character device, not a regular file; prepare the "
        f"corpus again with `bdh-train prepare ... --out {tmp_path} --force`"
    )
    tokens = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint16).tofile(tokens)
    (tmp_path / "t.bin.json").symlink_to(ZERO)
    with pytest.raises(DataError) as refused:
        load_tokens(str(tokens))
    assert str(refused.value).startswith(
        f"token header '{tmp_path / 't.bin.json'}' is a character device, not a regular file; "
        'expected {"dtype": '
    )
    assert time.monotonic() - started < QUICK_S


# ------------------------------------------------------------------ generate --prompts-file
PROMPTS_FIX = "write the prompts into a file and give its path (generate reads it twice)"


@pytest.mark.timeout(30)
def test_a_prompts_file_that_is_dev_zero_or_a_fifo_is_refused_at_once(
    tmp_path: Path, fifo: Path, bounded_memory
):
    from bdh_train.completions import read_prompts
    from bdh_train.data.tokenizer import ByteTokenizer

    started = time.monotonic()
    for target, kind in ((ZERO, "a character device"), (fifo, "a FIFO (named pipe)")):
        with pytest.raises(DataError) as refused:
            read_prompts(target, ByteTokenizer())
        assert str(refused.value) == (
            f"the prompts file {target} is {kind}, not a regular file; {PROMPTS_FIX}"
        )
    assert time.monotonic() - started < QUICK_S


@pytest.mark.timeout(60)
def test_a_prompts_file_line_over_the_limit_is_refused_with_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounded_memory
):
    from bdh_train import completions
    from bdh_train.data.tokenizer import ByteTokenizer

    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "a"}\n' + b" " * (completions.PROMPT_LINE_MAX_BYTES + 1))
    with pytest.raises(DataError) as refused:
        completions.read_prompts(prompts, ByteTokenizer())
    assert str(refused.value) == (
        f"{prompts}:2: the line is longer than 16 MiB (16777216 bytes), the most a line may hold"
    )
    monkeypatch.setattr(completions, "PROMPT_LINE_MAX_BYTES", 16)
    prompts.write_bytes(b'{"prompt": "ab"}\n{"prompt": "abc"}\n')  # 17 and 18 bytes a line
    with pytest.raises(DataError, match=r"p\.jsonl:1: the line is longer than 16 bytes"):
        completions.read_prompts(prompts, ByteTokenizer())
    monkeypatch.setattr(completions, "PROMPT_LINE_MAX_BYTES", 18)
    assert [r.ids for r in completions.read_prompts(prompts, ByteTokenizer())] == [
        [97, 98],
        [97, 98, 99],
    ]


@pytest.mark.timeout(120)
def test_a_large_prompts_file_is_checked_and_read_a_line_at_a_time(tmp_path: Path, bounded_memory):
    """200,000 prompts of 400 characters (80 MB): their records, held at once, would take
    far more than the 256 MiB `bounded_memory` leaves (a list of 400 ints is 3 KiB), so the
    check and the generation's read must each hold a line at a time."""
    import itertools
    import json

    from bdh_train.completions import read_prompts
    from bdh_train.data.tokenizer import ByteTokenizer

    n, width = 200_000, 400
    prompts = tmp_path / "many.jsonl"
    with open(prompts, "w") as handle:
        for i in range(n):
            handle.write(json.dumps({"id": i, "prompt": f"{i:0{width}d}"}) + "\n")
    records = read_prompts(prompts, ByteTokenizer())
    assert len(records) == n
    first = list(itertools.islice(records, 3))
    assert [r.fields["id"] for r in first] == [0, 1, 2]
    assert first[2].ids == list(f"{2:0{width}d}".encode())
    assert sum(1 for _ in records) == n  # read again, whole


def test_a_prompts_file_changed_after_its_check_is_refused_before_generating(
    tmp_path: Path,
) -> None:
    from bdh_train.completions import read_prompts
    from bdh_train.data.tokenizer import ByteTokenizer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    records = read_prompts(prompts, ByteTokenizer())
    prompts.write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    with pytest.raises(DataError) as refused:
        next(iter(records))
    assert str(refused.value) == (
        f"the prompts file {prompts} changed after it was checked; run generate again"
    )
