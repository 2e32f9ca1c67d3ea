"""Files a user names are read only when they are regular files, and whole only up to a size
limit the error states (`utils.read_regular_file`): a config file or one it extends, a
tokenizer, a prepared corpus's meta.json, a token header. /dev/zero (endless) and a FIFO (a
read waits for a writer) are refused at once with one error line, without filling memory:
each such test runs under `bounded_memory` (suite_setup.py) and a timeout."""

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
    from bdh_train.data.tokenizer import ByteTokenizer
    from bdh_train.generation.completions import read_prompts

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
    from bdh_train.data.tokenizer import ByteTokenizer
    from bdh_train.generation import completions

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
    """150,000 prompts of 400 characters (60 MB): their records, held at once, would take
    far more than the 256 MiB `bounded_memory` leaves (a list of 400 ints is 3 KiB: 490 MB
    of lists alone), so the check and the generation's read must each hold a line at a
    time."""
    import itertools
    import json

    from bdh_train.data.tokenizer import ByteTokenizer
    from bdh_train.generation.completions import read_prompts

    n, width = 150_000, 400
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
    from bdh_train.data.tokenizer import ByteTokenizer
    from bdh_train.generation.completions import read_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    records = read_prompts(prompts, ByteTokenizer())
    prompts.write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    with pytest.raises(DataError) as refused:
        next(iter(records))
    assert str(refused.value) == (
        f"the prompts file {prompts} changed after it was checked; run generate again"
    )


@pytest.mark.timeout(30)
def test_a_file_that_grows_after_its_size_check_is_read_no_further_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounded_memory
):
    """The size is checked with fstat, then the file grows by 1 GiB (sparse) before the read:
    read whole it would not fit under `bounded_memory`; read to the limit + 1 it is refused."""
    from bdh_train import utils

    path = tmp_path / "growing"
    path.write_bytes(b"0123456789")
    fstat, grown = os.fstat, []

    def fstat_then_grow(fd: int) -> os.stat_result:
        """The file's stat before it grew (every check sees 10 bytes); it grows meanwhile."""
        if os.readlink(f"/proc/self/fd/{fd}") != str(path):
            return fstat(fd)
        if not grown:
            grown.append(fstat(fd))
            os.truncate(path, 10 + (1 << 30))
        return grown[0]

    monkeypatch.setattr(utils.os, "fstat", fstat_then_grow)
    with pytest.raises(DataError) as refused:
        read_regular_file(path, 100, "growing", DataError)
    assert grown and str(refused.value) == "growing has more than the 100 bytes read"


# ------------------------------------------------------------ checkpoint and run files
HUGE = 2 << 30
"""A sparse file of 2 GiB: read whole, it would not fit under `bounded_memory`."""


def _checkpoint(run: Path) -> Path:
    from bdh_train.storage import checkpoint as ckpt

    def write(directory: Path) -> None:
        (directory / ckpt.MODEL_FILE).write_bytes(b"m")

    return ckpt.save_checkpoint(run, "step-0000001", write)


@pytest.mark.timeout(60)
def test_a_huge_latest_pointer_or_manifest_is_refused_without_reading_it(
    tmp_path: Path, bounded_memory
):
    from bdh_train.errors import CheckpointError
    from bdh_train.storage import checkpoint as ckpt

    started = time.monotonic()
    first = _checkpoint(tmp_path / "a")
    pointer = tmp_path / "a" / "checkpoints" / ckpt.LATEST
    os.truncate(pointer, HUGE)
    with pytest.raises(CheckpointError) as refused:
        ckpt.resolve_checkpoint(tmp_path / "a")
    assert str(refused.value) == (
        f"{pointer} has {HUGE} bytes, more than the 256 bytes read; write the name of a "
        "checkpoint directory into it (step-XXXXXXX), or delete it; the newest intact "
        f"checkpoint is {first} (resume from it with --resume-fallback; generate, eval and "
        "export read it as --checkpoint)"
    )
    ckpt.prune_checkpoints(pointer.parent, keep=1)  # reads the pointer too
    manifest = _checkpoint(tmp_path / "b") / ckpt.MANIFEST
    os.truncate(manifest, HUGE)
    with pytest.raises(CheckpointError) as refused:
        ckpt.verify_checkpoint(manifest.parent)
    assert str(refused.value) == (
        f"{manifest} has {HUGE} bytes, more than the 16 MiB (16777216 bytes) read; the "
        "checkpoint is damaged: use another checkpoint"
    )
    assert time.monotonic() - started < QUICK_S


@pytest.mark.timeout(60)
def test_a_huge_run_config_or_lock_file_is_refused_without_reading_it(
    tmp_path: Path, bounded_memory
):
    from bdh_train.errors import ConfigError
    from bdh_train.storage.run_dir import LOCK_FILE, RunDir, read_saved_config
    from bdh_train.train.optim import OptimizerConfig
    from bdh_train.train.state import check_resumed_optimizer

    started = time.monotonic()
    config = tmp_path / "config.toml"
    config.touch()
    os.truncate(config, HUGE)
    with pytest.raises(ConfigError) as refused:
        read_saved_config(tmp_path)
    assert str(refused.value) == (
        f"config file {config} has {HUGE} bytes, more than the 1 MiB (1048576 bytes) read"
    )
    check_resumed_optimizer(tmp_path, OptimizerConfig())  # a peek: nothing to compare with
    assert RunDir(tmp_path, fresh=False).moved_tokenizer_override() == []
    lock = tmp_path / LOCK_FILE
    lock.touch()
    os.truncate(lock, HUGE)
    run = RunDir(tmp_path, fresh=False)
    with pytest.raises(ConfigError) as refused:
        run.lock()
    assert str(refused.value) == (
        f"the lock file {lock} has {HUGE} bytes, more than the 4 KiB (4096 bytes) read; it is "
        "no lock bdh-train wrote (a pid): move it away or delete it"
    )
    assert lock.stat().st_size == HUGE  # refused before it was taken: the file is as it was
    assert time.monotonic() - started < QUICK_S


# ------------------------------------------------------------ sizes and values a file claims
def _write_checkpoint(directory: Path, model, config: dict | None = None) -> Path:
    """`model` as a checkpoint directory (weights and manifest; no run config), its
    bdh_config metadata `config` (default: the model's own)."""
    import json

    from safetensors.torch import save_file

    from bdh_train.storage import checkpoint as ckpt

    metadata = {"bdh_config": json.dumps(config or model.config.to_dict()), "step": "0"}
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / ckpt.MODEL_FILE), metadata=metadata)

    return ckpt.publish_checkpoint_dir(directory, write, "merge")


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory) -> Path:
    """An untrained byte-level model (vocab 256) as a checkpoint directory: what generate,
    chat, inspect, eval and merge load in a few milliseconds."""
    from helpers import tiny_model

    return _write_checkpoint(tmp_path_factory.mktemp("ck") / "ck", tiny_model(vocab_size=256))


@pytest.mark.timeout(60)
def test_a_fifo_or_device_as_data_or_state_is_refused_before_opening(
    byte_checkpoint: Path, tmp_path: Path, fifo: Path, capsys, bounded_memory
):
    """Each would hang on the FIFO (a read waits for a writer) or read /dev/zero forever."""
    from bdh_train.data.corpus_files import expand_sources

    ck = str(byte_checkpoint)
    fix = (
        "give a text file, a directory of .txt files, a .bin token file or a directory "
        "written by `bdh-train prepare`"
    )
    for target, kind in ((fifo, "a FIFO (named pipe)"), (ZERO, "a character device")):
        refused = f"data source '{target}' is {kind}, not a regular file or directory; {fix}"
        out = str(tmp_path / "out")
        for argv in (
            ["inspect", "--checkpoint", ck, "--data", str(target), "--out", out],
            ["eval", "--checkpoint", ck, "--data", str(target), "--device", "cpu"],
            ["merge", ck, ck, "--data", str(target), str(target), "--out", out]
            + ["--finetune-steps", "1"],
            ["train", "--run-dir", str(tmp_path / "run"), "--set", f"data.source={target}"],
        ):
            assert _one_error_line(capsys, argv) == refused, argv
        with pytest.raises(DataError) as refused_text:
            expand_sources([target])
        assert str(refused_text.value).startswith(
            f"source '{target}' is {kind}, not a regular file; give UTF-8 text"
        )
    fix = "give a file written by --save-state for this checkpoint"
    for command in ("generate", "chat"):
        argv = [command, "--checkpoint", ck, "--load-state", str(fifo), "--device", "cpu"]
        assert _one_error_line(capsys, argv) == (
            f"state file {fifo} is a FIFO (named pipe), not a regular file; {fix}"
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_a_checkpoint_config_larger_than_its_tensors_is_refused_before_building(
    tmp_path: Path, capsys, bounded_memory
):
    """A bdh_config multiplier edited to 160000: a model of 123M parameters (491 MB, which
    `bounded_memory` does not leave) for tensors of 10 KB."""
    from helpers import tiny_model

    model = tiny_model(vocab_size=256)
    edited = {**model.config.to_dict(), "mlp_internal_dim_multiplier": 160000}
    ck = _write_checkpoint(tmp_path / "ck", model, edited)
    error = _one_error_line(capsys, ["generate", "--checkpoint", str(ck), "--prompt", "a"])
    assert error.startswith(
        f"the bdh_config metadata of {ck / 'model.safetensors'} does not fit its tensors "
        "(mismatched shapes: decoder: checkpoint [64, 16] vs model [2560000, 16]; "
        "encoder: checkpoint [2, 16, 32] vs model [2, 16, 1280000]; "
    )
    assert error.endswith("): the file was changed or damaged")


def _ternary(tmp_path: Path, change=None) -> Path:
    """A ternary export of a byte-level BitNet model, its metadata then changed by
    `change(metadata, tensors)` and written back: a hand-edited export."""
    from helpers import tiny_model
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bdh_train.export.ternary import export_ternary
    from bdh_train.model import QuantConfig

    model = tiny_model(vocab_size=256, quant=QuantConfig(enable=True))
    path = export_ternary(model, tmp_path / "m.safetensors", training_json='{"block_size": 8}')
    if change is not None:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        change(metadata, tensors)
        save_file(tensors, str(path), metadata=metadata)
    return path


DEEP = "[" * 100_000 + "]" * 100_000
"""JSON nested past the parser's recursion limit."""


@pytest.mark.timeout(60)
def test_a_ternary_export_claiming_more_than_it_holds_or_nested_json_is_refused(
    tmp_path: Path, capsys, bounded_memory
):
    import json

    from bdh_train.errors import CheckpointError
    from bdh_train.storage.ternary import load_ternary

    def grown(metadata, tensors):
        config = json.loads(metadata["config"])
        metadata["config"] = json.dumps({**config, "mlp_internal_dim_multiplier": 160000})

    path = _ternary(tmp_path / "a", grown)
    with pytest.raises(CheckpointError) as refused:
        load_ternary(path)
    assert str(refused.value).startswith(
        f"the config of the ternary export '{path}' does not fit its tensors (mismatched "
        "shapes: decoder: checkpoint [64, 16] vs model [2560000, 16]; "
    )

    def huge_listing(metadata, tensors):
        metadata["ternary"] = json.dumps({"encoder": [1 << 20, 1 << 20], "decoder": [64, 16]})

    path = _ternary(tmp_path / "b", huge_listing)
    with pytest.raises(CheckpointError) as refused:
        load_ternary(path)
    assert str(refused.value) == (
        f"ternary export '{path}': encoder is listed as [1048576, 1048576] but its packed "
        "codes or scale do not hold that: the file was changed or damaged"
    )
    for key in ("config", "ternary", "training"):
        path = _ternary(tmp_path / key, lambda metadata, tensors, k=key: metadata.update({k: DEEP}))
        for argv in (
            ["generate", "--checkpoint", str(path), "--prompt", "a"],
            ["inspect", "--checkpoint", str(path), "--out", str(tmp_path / key / "out")],
            ["export", "--hf", str(tmp_path / key / "hf"), str(path)],
        ):
            error = _one_error_line(capsys, argv)
            assert (
                error == f"the {key!r} metadata of the ternary export '{path}' is nested too "
                "deep: the file was changed or damaged"
                if key != "training"
                else error.startswith(f"the training metadata of the export '{path}' is unusable")
            ), (argv, error)
        assert not (tmp_path / key / "out").exists() and not (tmp_path / key / "hf").exists()


def test_grow_counts_three_copies_of_the_grown_model_and_refuses_a_seed_past_64_bits(
    byte_checkpoint: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    from helpers import tiny_config

    from bdh_train.compose import grow as compose
    from bdh_train.model.bdh import parameter_bytes
    from bdh_train.model.surgery import grown_config

    for seed in (2**64, -(2**63) - 1):
        argv = ["grow", "--checkpoint", str(byte_checkpoint), "--neurons-multiplier", "2"]
        argv += ["--out", str(tmp_path / "g"), "--seed", str(seed)]
        assert _one_error_line(capsys, argv) == (
            f"--seed must be an integer from -2**63 to 2**64 - 1, got {seed}"
        )
    source = tiny_config()
    grown = grown_config(source, 4)
    need = 3 * parameter_bytes(grown) + parameter_bytes(source)
    monkeypatch.setattr(compose, "physical_memory", lambda: need)
    compose._check_grow_fits(source, grown, 4)  # exactly fits
    monkeypatch.setattr(compose, "physical_memory", lambda: need - 1)
    with pytest.raises(ConfigError) as refused:
        compose._check_grow_fits(source, grown, 4)
    assert str(refused.value).startswith(
        f"--neurons-multiplier 4 makes a model of {grown.parameter_count():.3g} parameters, "
        "and grow holds 3 copies of it besides the source ("
    )
