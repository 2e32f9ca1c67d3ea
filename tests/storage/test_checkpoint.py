"""Checkpoint directories as a database keeps them: pruned by step, never losing `latest` or
the one just written, re-saved by swapping, recovered after a crash, verified by SHA-256."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import random
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors import safe_open

from bdh_train.errors import BDHTrainError, CheckpointError, ConfigError
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage import dcp, output
from bdh_train.storage import manifest as ckpt_manifest
from bdh_train.utils import first_line


def save(run: Path, step: int, micro: int = 0, keep: int = 0, payload: bytes = b"w") -> Path:
    def write(directory: Path) -> None:
        (directory / ckpt.MODEL_FILE).write_bytes(payload + str(step).encode())
        (directory / "trainer.json").write_text("{}")

    return ckpt.save_checkpoint(run, ckpt.checkpoint_name(step, micro), write, keep)


def names(run: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(run / ckpt.CHECKPOINTS)]


def test_pruning_keeps_the_newest_by_step_not_by_name(tmp_path: Path) -> None:
    for step in (9_999_998, 9_999_999, 10_000_000):  # names stop sorting by step here
        save(tmp_path, step, keep=2)
    assert names(tmp_path) == ["step-9999999", "step-10000000"]
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-10000000"


def test_micro_step_checkpoints_order_after_their_step(tmp_path: Path) -> None:
    for step, micro in ((3, 0), (3, 2), (4, 0)):
        save(tmp_path, step, micro)
    assert names(tmp_path) == ["step-0000003", "step-0000003-m02", "step-0000004"]


def test_a_reused_directory_never_loses_the_checkpoint_just_written(tmp_path: Path) -> None:
    save(tmp_path, 9)  # left by an earlier run in the same directory
    save(tmp_path, 3, keep=1)
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-0000003"
    assert "step-0000003" in names(tmp_path)


def test_pruning_never_deletes_what_latest_names(tmp_path: Path) -> None:
    root = tmp_path / ckpt.CHECKPOINTS
    save(tmp_path, 1)
    save(tmp_path, 2)
    (root / ckpt.LATEST).write_text("step-0000001\n")  # rolled back by hand
    ckpt.prune_checkpoints(root, keep=1)
    assert names(tmp_path) == ["step-0000001", "step-0000002"]


def test_a_resave_swaps_and_a_crash_mid_swap_is_recovered(tmp_path: Path) -> None:
    root = tmp_path / ckpt.CHECKPOINTS
    first = save(tmp_path, 5, payload=b"old")
    second = save(tmp_path, 5, payload=b"new")
    assert second == first and (second / ckpt.MODEL_FILE).read_bytes() == b"new5"
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, "step-0000005"]
    # A crash after the old copy was set aside and before the new one arrived, plus a
    # half-written temporary directory: recovery brings the old copy back, drops the rest.
    aside = root / ".old-step-0000005-abc123"
    aside.mkdir()
    (root / "step-0000005").rename(aside / "checkpoint")
    (root / ".tmp-step-0000006-xyz").mkdir()
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.resolve_checkpoint(tmp_path)
    ckpt.recover_checkpoints(root)
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, "step-0000005"]
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-0000005"


def test_a_flipped_byte_is_caught_and_the_newest_intact_checkpoint_offered(
    tmp_path: Path,
) -> None:
    save(tmp_path, 1)
    latest = save(tmp_path, 2)
    model = latest / ckpt.MODEL_FILE
    data = bytearray(model.read_bytes())
    data[0] ^= 1
    model.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint(tmp_path)
    message = str(err.value)
    assert "does not match its SHA-256" in message and "step-0000001" in message
    assert "--resume-fallback" in message
    assert ckpt.resolve_checkpoint(tmp_path, fallback=True).name == "step-0000001"


def test_latest_must_name_a_checkpoint_inside_the_run(tmp_path: Path) -> None:
    outside = save(tmp_path / "other", 7)
    save(tmp_path, 1)
    (tmp_path / ckpt.CHECKPOINTS / ckpt.LATEST).write_text(str(outside) + "\n")
    with pytest.raises(CheckpointError, match="not the name of a checkpoint directory"):
        ckpt.resolve_checkpoint(tmp_path)


# ---------------------------------------------------------------- names, config, files
def test_names_and_positions_are_exact() -> None:
    assert ckpt.checkpoint_name(10) == "step-0000010"
    assert ckpt.checkpoint_name(10, 1) == "step-0000010-m01"
    assert ckpt.checkpoint_position("step-0000010") == (10, 0)
    assert ckpt.checkpoint_position("step-12345678-m123") == (12345678, 123)
    for other in ("step-000001", "step-0000001-m1", "xstep-0000001", "step-0000001-", "latest"):
        assert ckpt.checkpoint_position(other) is None


def test_checkpoint_config_validates_both_strings() -> None:
    config = ckpt.CheckpointConfig()
    assert config.validate() is config and (config.init_from, config.resume) == ("", "")
    with pytest.raises(ConfigError) as err:
        ckpt.CheckpointConfig(init_from=1).validate()  # type: ignore[arg-type]
    assert str(err.value) == "checkpoint.init_from must be a string, got 1"
    with pytest.raises(ConfigError) as err:
        ckpt.CheckpointConfig(resume=None).validate("x")  # type: ignore[arg-type]
    assert str(err.value) == "x.resume must be a string, got None"


def test_json_is_written_sorted_and_indented_and_read_errors_name_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.json"
    ckpt.write_json(path, {"b": 1, "a": [2]})
    assert path.read_text() == '{\n "a": [\n  2\n ],\n "b": 1\n}'
    assert ckpt.read_json(path) == {"a": [2], "b": 1}
    path.write_text("{")
    with pytest.raises(CheckpointError) as err:
        ckpt.read_json(path)
    assert str(err.value) == (
        f"cannot read {path}: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)"
    )
    with pytest.raises(CheckpointError) as err:
        ckpt.read_json(tmp_path / "none.json")
    assert str(err.value).startswith(f"cannot read {tmp_path / 'none.json'}: [Errno 2]")


def test_first_line_drops_torch_locations_and_blank_lines() -> None:
    exc = RuntimeError("\n  [enforce fail at inline_container.cc:1] . first  \nsecond")
    assert first_line(exc) == "first"
    assert first_line(RuntimeError("a [enforce fail at x.cc:2]  b")) == "a b"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(ValueError(" \n ")) == "ValueError"


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "b.bin").write_bytes(b"x" * 3)
    (tmp_path / "sub" / "deeper" / "a.txt").write_bytes(b"")
    assert ckpt_manifest._checkpoint_files(tmp_path) == [
        tmp_path / "b.bin",
        tmp_path / "sub" / "deeper" / "a.txt",
    ]
    ckpt.write_manifest(tmp_path)
    ckpt.write_manifest(tmp_path)  # a second manifest does not list the first
    assert json.loads((tmp_path / ckpt.MANIFEST).read_text()) == {
        "files": {
            "b.bin": {"bytes": 3, "sha256": hashlib.sha256(b"xxx").hexdigest()},
            "sub/deeper/a.txt": {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()},
        }
    }
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 4097)  # more than one 1 MiB block
    assert ckpt_manifest._sha256(big) == hashlib.sha256(big.read_bytes()).hexdigest()


def _verified(directory: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        ckpt.verify_checkpoint(directory)
    return str(err.value)


def test_verify_names_each_defect_exactly(tmp_path: Path) -> None:
    assert _verified(tmp_path) == f"checkpoint {tmp_path} has no model.safetensors"
    (tmp_path / ckpt.MODEL_FILE).mkdir()
    assert _verified(tmp_path) == f"checkpoint {tmp_path} has no model.safetensors"
    (tmp_path / ckpt.MODEL_FILE).rmdir()
    (tmp_path / ckpt.MODEL_FILE).write_bytes(b"abc")
    assert _verified(tmp_path) == (  # test_checkpoint_trust.py has v0.1's, the exception
        f"checkpoint {tmp_path} has no manifest.json and is not one v0.1 wrote (the only kind "
        "without): it is incomplete or was changed"
    )
    manifest = tmp_path / ckpt.MANIFEST
    for bad in ([], {"files": []}, {"other": {}}):
        manifest.write_text(json.dumps(bad))
        assert _verified(tmp_path) == f"{manifest} lists no files"
    sha = hashlib.sha256(b"abc").hexdigest()
    manifest.write_text(json.dumps({"files": {"model.safetensors": {"sha256": sha, "bytes": 3}}}))
    ckpt.verify_checkpoint(tmp_path)
    changed = (
        f"checkpoint {tmp_path}: model.safetensors does not match its SHA-256 in manifest.json "
        "(the file was changed or damaged)"
    )
    for entry in ({"sha256": sha, "bytes": 4}, {"sha256": sha[::-1], "bytes": 3}):
        manifest.write_text(json.dumps({"files": {"model.safetensors": entry}}))
        assert _verified(tmp_path) == changed
    manifest.write_text(json.dumps({"files": {"gone.pt": {"sha256": sha, "bytes": 3}}}))
    assert _verified(tmp_path) == f"checkpoint {tmp_path} is missing gone.pt"
    (tmp_path / "gone.pt").mkdir()
    assert _verified(tmp_path) == f"checkpoint {tmp_path} is missing gone.pt"


# ---------------------------------------------------------------- save, recover, resolve
def test_make_temp_dir_is_hidden_inside_checkpoints_with_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        run = tmp_path / "a" / "run"
        tmp = ckpt.make_temp_dir(run, "step-0000001")
        again = ckpt.make_temp_dir(run, "step-0000001")
    finally:
        os.umask(old)
    assert tmp.parent == run / "checkpoints" and again != tmp
    assert tmp.name.startswith(".tmp-step-0000001-") and tmp.is_dir()
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o750


def test_save_writes_the_manifest_before_the_hook_and_latest_after(tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def hook(tmp: Path) -> None:
        assert tmp.name.startswith(".tmp-step-0000002-")
        assert not (tmp_path / "checkpoints" / ckpt.LATEST).exists()
        seen.append(sorted(p.name for p in tmp.iterdir()))

    def write(directory: Path) -> None:
        (directory / "sub").mkdir()
        (directory / "sub" / "shard").write_bytes(b"s")
        (directory / ckpt.MODEL_FILE).write_bytes(b"m")

    final = ckpt.save_checkpoint(tmp_path, "step-0000002", write, before_rename=hook)
    assert final == tmp_path / "checkpoints" / "step-0000002"
    assert seen == [[ckpt.MANIFEST, ckpt.MODEL_FILE, "sub"]]
    assert (tmp_path / "checkpoints" / ckpt.LATEST).read_text() == "step-0000002\n"
    assert set(json.loads((final / ckpt.MANIFEST).read_text())["files"]) == {
        ckpt.MODEL_FILE,
        "sub/shard",
    }
    ckpt.verify_checkpoint(final)


def test_a_failed_save_leaves_the_previous_checkpoint_and_pointer(tmp_path: Path) -> None:
    save(tmp_path, 1, payload=b"old")
    root = tmp_path / "checkpoints"

    def crash(tmp: Path) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, "step-0000001", lambda d: None, before_rename=crash)

    def vanish(directory: Path) -> None:  # the temporary directory is gone: still the cause
        shutil.rmtree(directory)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, "step-0000002", vanish)
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, "step-0000001"]
    assert (root / "step-0000001" / ckpt.MODEL_FILE).read_bytes() == b"old1"
    assert (root / ckpt.LATEST).read_text() == "step-0000001\n"


def test_save_into_a_given_temporary_directory_and_keep_zero_keeps_all(tmp_path: Path) -> None:
    tmp = ckpt.make_temp_dir(tmp_path, "step-0000003")
    (tmp / "shard").write_bytes(b"from another rank")
    save(tmp_path, 1)
    final = ckpt.save_checkpoint(
        tmp_path, "step-0000003", lambda d: (d / ckpt.MODEL_FILE).write_bytes(b"m"), tmp=tmp
    )
    assert (final / "shard").read_bytes() == b"from another rank" and not tmp.exists()
    save(tmp_path, 4, keep=0)
    assert names(tmp_path) == ["step-0000001", "step-0000003", "step-0000004"]
    save(tmp_path, 5, keep=2)
    assert names(tmp_path) == ["step-0000004", "step-0000005"]


def test_recovery_keeps_checkpoints_and_drops_debris(tmp_path: Path) -> None:
    ckpt.recover_checkpoints(tmp_path / "missing")  # nothing to recover: no error
    root = tmp_path / ckpt.CHECKPOINTS
    save(tmp_path, 5, payload=b"new")
    replaced = root / ".old-step-0000005-a"  # the swap finished: the old copy just goes
    (replaced / "checkpoint").mkdir(parents=True)
    (replaced / "checkpoint" / "x").write_bytes(b"old")
    odd = root / ".old-notastep-b"  # not a checkpoint's name: dropped, not restored
    (odd / "checkpoint").mkdir(parents=True)
    (root / ".old-step-0000006-c").mkdir()  # nothing set aside inside
    (root / ".tmp-file").write_bytes(b"")  # files with these prefixes are left alone
    (root / ".old-step-0000007-d").write_bytes(b"")
    ckpt.recover_checkpoints(root)
    assert sorted(p.name for p in root.iterdir()) == [
        ".old-step-0000007-d",
        ".tmp-file",
        ckpt.LATEST,
        "step-0000005",
    ]
    assert (root / "step-0000005" / ckpt.MODEL_FILE).read_bytes() == b"new5"


def test_list_checkpoints_takes_only_checkpoint_directories(tmp_path: Path) -> None:
    save(tmp_path, 2)
    root = tmp_path / ckpt.CHECKPOINTS
    (root / "step-0000001").write_bytes(b"")
    (root / "step-1").mkdir()
    assert ckpt.list_checkpoints(root) == [root / "step-0000002"]


def test_resolve_accepts_a_run_checkpoints_or_checkpoint_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint(missing)
    assert str(err.value) == f"checkpoint path {missing} does not exist"
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint(tmp_path)
    assert str(err.value) == (
        f"no checkpoint found at {tmp_path}: expected a run directory with checkpoints/latest, "
        "or a directory holding model.safetensors"
    )
    first = save(tmp_path, 1)
    final = save(tmp_path, 2)
    for path in (tmp_path, tmp_path / "checkpoints", final, str(final)):
        assert ckpt.resolve_checkpoint(path) == final
    assert ckpt.resolve_checkpoint(first) == first
    (first / ckpt.MODEL_FILE).write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        ckpt.resolve_checkpoint(first)


def test_a_pointer_to_a_missing_checkpoint_offers_the_newest_intact(tmp_path: Path) -> None:
    root = tmp_path / ckpt.CHECKPOINTS
    first = save(tmp_path, 1)
    save(tmp_path, 2)
    (root / ckpt.LATEST).write_text("step-0000009\n")
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint(tmp_path)
    assert str(err.value) == (
        f"{root / ckpt.LATEST} points to step-0000009, which is missing; the newest intact "
        f"checkpoint is {root / 'step-0000002'} (resume from it with --resume-fallback; "
        "generate, eval and export read it as --checkpoint)"
    )
    (root / "step-0000002" / ckpt.MODEL_FILE).write_bytes(b"damaged")
    assert ckpt.newest_intact_checkpoint(root) == first
    assert ckpt.resolve_checkpoint(tmp_path, fallback=True) == first
    (first / ckpt.MODEL_FILE).unlink()
    assert ckpt.newest_intact_checkpoint(root) is None
    # a damaged pointer is echoed escaped (no byte reaches the terminal raw) and cut short
    (root / ckpt.LATEST).write_bytes(b"\xff step\x00\x1b[31m" + b"x" * 100 + b"\n")
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_checkpoint(tmp_path, fallback=True)
    assert str(err.value) == (
        f"{root / ckpt.LATEST} holds '\\ufffd step\\x00\\x1b[31m{'x' * 48}'... (112 characters), "
        f"not the name of a checkpoint directory inside {root} (step-XXXXXXX); no intact "
        "checkpoint is left"
    )


# ---------------------------------------------------------------- pieces of a checkpoint
def _linear() -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(6.0).view(3, 2))
        layer.bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
    return layer


def test_load_into_model_lists_every_mismatch(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 3)
    weights = {"weight": torch.zeros(2, 3), "extra": torch.zeros(1), "zz": torch.zeros(1)}
    with pytest.raises(CheckpointError) as err:
        ckpt.load_into_model(model, weights, tmp_path)
    assert str(err.value) == (
        f"checkpoint {tmp_path} does not fit this model (missing keys ['bias'], unexpected "
        "keys ['extra', 'zz'], mismatched shapes: weight: checkpoint [2, 3] vs model [3, 2]); "
        "check that [model] matches the run that wrote it"
    )
    with pytest.raises(CheckpointError) as err:
        ckpt.load_into_model(model, {"weight": torch.zeros(3, 2)}, tmp_path)
    assert "(missing keys ['bias']); check" in str(err.value)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_into_model(model, {**_linear().state_dict(), "b": torch.zeros(1)}, tmp_path)
    assert "(unexpected keys ['b']); check" in str(err.value)
    two = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    wrong = {k: v.t() if v.dim() == 2 else v for k, v in two.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        ckpt.load_into_model(two, wrong, tmp_path)
    assert (
        "(mismatched shapes: 0.weight: checkpoint [2, 3] vs model [3, 2]; 1.weight: "
        "checkpoint [3, 1] vs model [1, 3]); check" in str(err.value)
    )
    ckpt.load_into_model(model, _linear().state_dict(), tmp_path)
    assert torch.equal(model.weight, _linear().weight) and torch.equal(model.bias, _linear().bias)


def test_model_weights_round_trip_through_safetensors(tmp_path: Path) -> None:
    part = ckpt.ModelWeights(_linear(), lambda: {"format": "pt"})
    tensors, metadata = part.state_dict()
    assert metadata == {"format": "pt"} and set(tensors) == {"weight", "bias"}
    assert not tensors["weight"].requires_grad
    gathered = ckpt.ModelWeights(
        torch.nn.Linear(2, 3), dict, tensors=lambda: {"w": torch.ones(2, 2).t()}
    )
    assert gathered.state_dict()[0]["w"].is_contiguous()
    path = tmp_path / ckpt.MODEL_FILE
    ckpt._write_part(path, part.state_dict())
    weights, where = ckpt._read_part(path)
    assert where == tmp_path and torch.equal(weights["bias"], torch.tensor([1.0, 2.0, 3.0]))
    assert safe_open(str(path), "pt").metadata() == {"format": "pt"}
    fresh = ckpt.ModelWeights(torch.nn.Linear(2, 3), dict)
    with pytest.raises(CheckpointError, match=f"^checkpoint {tmp_path} does not fit"):
        fresh.load_state_dict(({"weight": weights["weight"]}, where))
    fresh.load_state_dict((weights, where))
    assert torch.equal(fresh.model.weight, _linear().weight)
    assert ckpt.load_model_weights(tmp_path).keys() == {"weight", "bias"}
    path.write_bytes(b"\x08")
    with pytest.raises(CheckpointError) as err:
        ckpt.load_model_weights(tmp_path)
    cause = err.value.__cause__
    assert cause is not None
    assert str(err.value) == f"cannot read {path}: {first_line(cause)}"


class _Custom:
    pass


def test_parts_are_written_in_the_format_their_suffix_names(tmp_path: Path) -> None:
    ckpt._write_part(tmp_path / "config.toml", "a = 1\n")
    assert (tmp_path / "config.toml").read_text() == "a = 1\n"
    ckpt._write_part(tmp_path / "t.json", {"b": [1]})
    assert (tmp_path / "t.json").read_text() == '{\n "b": [\n  1\n ]\n}'
    assert ckpt._read_part(tmp_path / "t.json") == {"b": [1]}
    ckpt._write_part(tmp_path / "o.pt", {"x": torch.arange(3)})
    loaded = ckpt._read_part(tmp_path / "o.pt")
    assert torch.equal(loaded["x"], torch.arange(3)) and loaded["x"].device.type == "cpu"
    for call in (ckpt._write_part, ckpt._read_part):
        with pytest.raises(ValueError) as err:
            call(tmp_path / "x.bin", {}) if call is ckpt._write_part else call(tmp_path / "x.bin")
        assert str(err.value) == "no checkpoint format for x.bin"


def test_torch_load_refuses_damaged_files_and_arbitrary_objects(tmp_path: Path) -> None:
    path = tmp_path / "o.pt"
    torch.save({"obj": _Custom()}, path)
    with pytest.raises(CheckpointError) as err:
        ckpt.torch_load(path)
    assert str(err.value).startswith(f"cannot read {path} (Weights only load failed.")
    path.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError) as err:
        ckpt.torch_load(path)
    cause = err.value.__cause__
    assert cause is not None and first_line(cause) in str(err.value)
    assert str(err.value) == (
        f"cannot read {path} ({first_line(cause)}); the file is damaged: resume from "
        "another checkpoint"
    )


def test_rng_state_round_trips_through_json_like_lists() -> None:
    state = ckpt.capture_rng_state()
    assert set(state) == {"python", "numpy", "torch"} or torch.cuda.is_available()
    assert isinstance(state["numpy"][1], list) and state["numpy"][0] == "MT19937"
    draws = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    python = state["python"]
    relisted = {**state, "python": [python[0], list(python[1]), python[2]]}
    ckpt.restore_rng_state(relisted)
    again = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    assert draws[:3] == again[:3] and torch.equal(draws[3], again[3])
    np.random.randn()  # leaves a cached gaussian in numpy's state
    cached = ckpt.capture_rng_state()
    first = np.random.randn()
    ckpt.restore_rng_state(cached)
    assert np.random.randn() == first
    assert np.random.get_state()[1].dtype == np.uint32


def test_io_advice_and_the_write_error_name_the_way_back(tmp_path: Path) -> None:
    empty = (
        "no checkpoint was written: free space (or raise the file size limit, or make the "
        "directory writable), then start again"
    )
    assert ckpt.io_advice(tmp_path) == empty
    last = save(tmp_path, 4)
    advice = (
        f"the last checkpoint, {last}, is intact: free space (or raise the file size limit, "
        f"or make the directory writable), then continue with: bdh-train train --resume "
        f"{tmp_path}"
    )
    assert ckpt.io_advice(tmp_path) == advice
    error = ckpt.CheckpointWriteError(tmp_path, tmp_path / "f", OSError(28, "No space left"))
    assert isinstance(error, BDHTrainError)
    assert str(error) == f"cannot write {tmp_path / 'f'} ([Errno 28] No space left); {advice}"


def test_a_short_write_on_a_full_disk_is_named_a_full_disk(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer reports ENOSPC as 'unexpected pos A vs B', without an errno: with
    less than FULL_DISK_BYTES free the reason says the disk is full; with more, or for an
    OSError that names its own cause, the error's first line stands alone."""
    short = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1920 vs 1812")
    usage = shutil.disk_usage(tmp_path)
    free = {"bytes": ckpt.FULL_DISK_BYTES - 1}
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=free["bytes"]))
    assert ckpt.write_failure(tmp_path, short) == (
        f"No space left on device: {ckpt.FULL_DISK_BYTES - 1:,} bytes free; "
        "unexpected pos 1920 vs 1812"
    )
    limit = OSError(27, "File too large")
    assert ckpt.write_failure(tmp_path, limit) == "[Errno 27] File too large"
    free["bytes"] = ckpt.FULL_DISK_BYTES
    assert ckpt.write_failure(tmp_path, short) == "unexpected pos 1920 vs 1812"
    free["bytes"] = 0
    error = ckpt.CheckpointWriteError(tmp_path, tmp_path / "f", short)
    assert str(error).startswith(
        f"cannot write {tmp_path / 'f'} (No space left on device: 0 bytes free; "
        "unexpected pos 1920 vs 1812); "
    )


# ---------------------------------------------------------------- the Checkpointer
class _Part:
    def __init__(self, state: Any = None, error: BaseException | None = None) -> None:
        self.state, self.error, self.loaded = state, error, []

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.loaded.append(state)
        if self.error is not None:
            raise self.error


def test_checkpointer_saves_and_loads_every_part(tmp_path: Path) -> None:
    (tmp_path / ckpt.CHECKPOINTS / ".tmp-step-0000001-x").mkdir(parents=True)
    ckpt.Checkpointer(tmp_path, is_main=False)
    assert (tmp_path / ckpt.CHECKPOINTS / ".tmp-step-0000001-x").exists()  # only main recovers
    saver = ckpt.Checkpointer(tmp_path, keep=1)
    assert not (tmp_path / ckpt.CHECKPOINTS / ".tmp-step-0000001-x").exists()
    parts = {
        "trainer.json": _Part({"step": 3}),
        ckpt.MODEL_FILE: ckpt.ModelWeights(_linear(), lambda: {"k": "v"}),
        "optimizer.pt": _Part({"t": torch.ones(2)}),
        "config.toml": _Part("x = 1\n"),
    }
    seen: list[Path] = []
    assert ckpt.Checkpointer(tmp_path, is_main=False).save("step-0000001", parts) is None
    assert not (tmp_path / ckpt.CHECKPOINTS / "step-0000001").exists()
    saver.save("step-0000001", parts)
    final = saver.save("step-0000003", parts, before_rename=seen.append)
    assert final == tmp_path / ckpt.CHECKPOINTS / "step-0000003" and len(seen) == 1
    assert names(tmp_path) == ["step-0000003"]  # keep = 1
    assert (final / "config.toml").read_text() == "x = 1\n"
    model = ckpt.ModelWeights(torch.nn.Linear(2, 3), dict)
    trainer, optimizer, config = _Part(), _Part(), _Part()
    saver.load(final, {"trainer.json": trainer, ckpt.MODEL_FILE: model, "optimizer.pt": optimizer})
    assert trainer.loaded == [{"step": 3}] and torch.equal(model.model.bias, _linear().bias)
    assert torch.equal(optimizer.loaded[0]["t"], torch.ones(2)) and config.loaded == []
    (final / ckpt.MODEL_FILE).write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        saver.load(final, {"trainer.json": trainer})


def test_checkpointer_load_wraps_what_a_part_refuses(tmp_path: Path) -> None:
    saver = ckpt.Checkpointer(tmp_path)
    final = saver.save("step-0000001", {"a.json": _Part([1]), ckpt.MODEL_FILE: _Part(({}, {}))})
    assert final is not None
    for error in (ValueError("v"), KeyError("k"), TypeError("t"), IndexError("i")):
        with pytest.raises(CheckpointError) as err:
            saver.load(final, {"a.json": _Part(error=error)})
        assert str(err.value) == (f"checkpoint {final} does not fit this run (a.json): {error}")
        assert err.value.__cause__ is error
    own = ConfigError("world size")
    with pytest.raises(ConfigError) as err:
        saver.load(final, {"a.json": _Part(error=own)})
    assert err.value is own
    first, second = _Part(error=RuntimeError("stop")), _Part()
    with pytest.raises(RuntimeError):
        saver.load(final, {"a.json": first, "b.json": second})
    assert first.loaded == [[1]] and second.loaded == []


def test_checkpointer_write_failures_name_the_file_and_leave_nothing(tmp_path: Path) -> None:
    saver = ckpt.Checkpointer(tmp_path)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        saver.save("step-0000001", {"a.json": _Part({"x": object()})})
    where = tmp_path / ckpt.CHECKPOINTS / "step-0000001" / "a.json"
    assert str(err.value) == (
        f"cannot write {where} (Object of type object is not JSON serializable); "
        f"{ckpt.io_advice(tmp_path)}"
    )
    assert isinstance(err.value.__cause__, TypeError)
    assert [p.name for p in (tmp_path / ckpt.CHECKPOINTS).iterdir()] == []


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return optimizer


class _CopyingLinear(torch.nn.Linear):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return {k: v.clone() for k, v in super().state_dict(*args, **kwargs).items()}


def test_a_sharded_state_round_trips_in_one_process(tmp_path: Path) -> None:
    assert dcp._one_process()
    model = _linear()
    saver = ckpt.Checkpointer(tmp_path)
    sharded = ckpt.ShardedState(model, _adam(model))
    final = saver.save("step-0000001", {ckpt.MODEL_FILE: _Part(({}, {}))}, sharded=sharded)
    assert final is not None and (final / ckpt.SHARDED_DIR / ".metadata").is_file()
    fresh = torch.nn.Linear(2, 3)
    optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    saver.load(final, {}, sharded=ckpt.ShardedState(fresh, optimizer))
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    saved = sharded.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved)
    other = torch.nn.Linear(2, 4)
    with pytest.raises(CheckpointError) as err:
        saver.load(final, {}, sharded=ckpt.ShardedState(other, _adam(other)))
    cause = err.value.__cause__
    assert cause is not None
    assert str(err.value) == (
        f"cannot read the sharded state {final / 'sharded'}: {first_line(cause)}; check "
        "that [model] matches the run that wrote it, or resume from another checkpoint"
    )
    copying = _CopyingLinear(2, 3)  # its state dict is a copy: set_state_dict writes it back
    ckpt.ShardedState(copying, torch.optim.Adam(copying.parameters())).load(final / "sharded")
    assert torch.equal(copying.weight, model.weight)


def test_a_sharded_state_saves_and_loads_in_one_process_without_warnings(tmp_path: Path) -> None:
    """DCP warns on every save and load without a process group; the CLI's stderr would carry
    two lines per resume of a one-process sharded run."""
    model = _linear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        saver = ckpt.Checkpointer(tmp_path)
        sharded = ckpt.ShardedState(model, _adam(model))
        final = saver.save("step-0000001", {ckpt.MODEL_FILE: _Part(({}, {}))}, sharded=sharded)
        assert final is not None
        fresh = torch.nn.Linear(2, 3)
        saver.load(
            final, {}, sharded=ckpt.ShardedState(fresh, torch.optim.Adam(fresh.parameters()))
        )
    assert [str(w.message) for w in seen] == []
    assert torch.equal(fresh.weight, model.weight)


def test_a_failed_sharded_save_names_the_shards_and_removes_the_temporary(
    tmp_path: Path, single_process_group: None
) -> None:
    assert not dcp._one_process()

    class Blocked(ckpt.ShardedState):  # DCP's own failure: a CheckpointException
        def save(self, directory: Path) -> None:
            directory.write_bytes(b"")  # a file where DCP makes its directory
            super().save(directory)

    model = _linear()
    saver = ckpt.Checkpointer(tmp_path)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        saver.save("step-0000002", {}, sharded=Blocked(model, _adam(model)))
    where = tmp_path / ckpt.CHECKPOINTS / "step-0000002" / ckpt.SHARDED_DIR
    assert str(err.value).startswith(f"cannot write {where} (CheckpointException ranks:")
    assert str(err.value).endswith(f"); {ckpt.io_advice(tmp_path)}")
    assert list((tmp_path / ckpt.CHECKPOINTS).iterdir()) == []
    tmp = saver._shared_temp_dir("step-0000003")  # made by this rank, broadcast to all
    assert tmp.parent == tmp_path / ckpt.CHECKPOINTS and tmp.name.startswith(".tmp-step-0000003-")
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"")  # a file where the run directory should be
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        ckpt.Checkpointer(blocked)._shared_temp_dir("step-0000004")
    assert str(err.value).startswith(f"cannot write {blocked / 'checkpoints'} ([Errno 20] ")


def test_pruning_without_a_pointer_and_past_an_undeletable_entry(tmp_path: Path) -> None:
    root = tmp_path / ckpt.CHECKPOINTS
    for step in (1, 2, 3):
        save(tmp_path, step)
    (root / ckpt.LATEST).unlink()
    (tmp_path / "elsewhere").mkdir()
    (root / "step-0000000").symlink_to(tmp_path / "elsewhere")  # rmtree refuses a link
    ckpt.prune_checkpoints(root, keep=1)
    assert names(tmp_path) == ["step-0000000", "step-0000003"]


def test_a_resave_sets_the_old_copy_aside_inside_checkpoints_and_syncs_every_directory(
    tmp_path: Path,
) -> None:
    save(tmp_path, 5, payload=b"old")
    root = tmp_path / ckpt.CHECKPOINTS
    made: list[Path] = []
    synced: list[Path] = []
    mkdtemp, fsync_dir = tempfile.mkdtemp, output.fsync_dir

    def recording(*args: Any, **kwargs: Any) -> str:
        made.append(Path(mkdtemp(*args, **kwargs)))
        return str(made[-1])

    def write(directory: Path) -> None:
        (directory / "shards" / "deep").mkdir(parents=True)
        (directory / ckpt.MODEL_FILE).write_bytes(b"new")

    with (
        mock.patch.object(tempfile, "mkdtemp", recording),
        mock.patch.object(output, "fsync_dir", lambda p: (synced.append(p), fsync_dir(p))),
    ):
        ckpt.save_checkpoint(tmp_path, "step-0000005", write)
    tmp, aside = made
    assert aside.parent == root and aside.name.startswith(".old-step-0000005-")
    assert not aside.exists() and (root / "step-0000005" / ckpt.MODEL_FILE).read_bytes() == b"new"
    assert sorted(synced) == sorted([tmp, tmp / "shards", tmp / "shards" / "deep", root])


@pytest.mark.parametrize("how", ["save_checkpoint", "publish_checkpoint_dir"])
def test_every_file_is_on_disk_before_the_directory_is_renamed_into_place(
    tmp_path: Path, how: str
) -> None:
    """A crash just after the rename must find whole files: each file of the checkpoint
    (the manifest and a nested one included) is fsynced before its directory is renamed."""
    events: list[tuple[str, int]] = []  # ("fsync", inode) and ("rename", 0), in order
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def synced(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def moved(real: Callable[..., None]) -> Callable[..., None]:
        def move(src: Any, dst: Any) -> None:
            if ".tmp-" in Path(src).name:  # save_checkpoint: .tmp-NAME; publish_dir: .NAME.tmp-
                events.append(("rename", 0))
            real(src, dst)

        return move

    def write(directory: Path) -> None:
        (directory / "shards").mkdir()
        (directory / "shards" / "0.distcp").write_bytes(b"shard")
        (directory / ckpt.MODEL_FILE).write_bytes(b"weights")

    with (
        mock.patch.object(os, "fsync", synced),
        mock.patch.object(os, "replace", moved(replace)),
        mock.patch.object(os, "rename", moved(rename)),
    ):
        if how == "save_checkpoint":
            final = ckpt.save_checkpoint(tmp_path, "step-0000001", write)
        else:
            final = ckpt.publish_checkpoint_dir(tmp_path / "out", write, "merge")
    renamed = events.index(("rename", 0))
    before = {inode for kind, inode in events[:renamed] if kind == "fsync"}
    files = [p for p in final.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["0.distcp", ckpt.MANIFEST, ckpt.MODEL_FILE]
    assert [p.name for p in files if p.stat().st_ino not in before] == []


def test_a_set_aside_copy_that_cannot_be_removed_does_not_fail_the_save(tmp_path: Path) -> None:
    save(tmp_path, 5)
    rmtree = shutil.rmtree

    def failing(path: Any, ignore_errors: bool = False, **kwargs: Any) -> None:
        if Path(path).name.startswith(".old-"):
            if not ignore_errors:
                raise OSError("busy")
            return
        rmtree(path, ignore_errors=ignore_errors, **kwargs)

    with mock.patch.object(shutil, "rmtree", failing):
        assert save(tmp_path, 5, payload=b"new").name == "step-0000005"


def test_text_parts_are_written_in_utf8_whatever_the_locale(tmp_path: Path) -> None:
    used: list[Any] = []
    write_text = Path.write_text

    def spy(self: Path, data: str, encoding: Any = None, **kwargs: Any) -> int:
        used.append(encoding)
        return write_text(self, data, encoding=encoding, **kwargs)

    with mock.patch.object(Path, "write_text", spy):
        ckpt._write_part(tmp_path / "tokenizer.json", "é")
    assert codecs.lookup(used[0]).name == "utf-8"
    assert (tmp_path / "tokenizer.json").read_bytes() == "é".encode()


def test_checkpointer_defaults_and_a_shard_failure_after_its_directory_vanished(
    tmp_path: Path,
) -> None:
    assert ckpt.Checkpointer(tmp_path).keep == 0

    class Vanishing(ckpt.ShardedState):
        def save(self, directory: Path) -> None:
            assert directory.parent.name.startswith(".tmp-step-0000001-")
            shutil.rmtree(directory.parent)  # removing the temporary directory now fails
            raise OSError(28, "No space left")

    model = _linear()
    with pytest.raises(ckpt.CheckpointWriteError, match=r"\(\[Errno 28\] No space left\)"):
        ckpt.Checkpointer(tmp_path).save("step-0000001", {}, sharded=Vanishing(model, _adam(model)))


def test_a_sharded_state_written_before_the_rope_table_loads_with_the_default_table(tmp_path):
    """DCP shards of a model without `rope_freqs` (written before models kept the table)
    load into today's model, which gets rope_frequencies(N), and every saved tensor."""
    from helpers import tiny_model

    from bdh_train.model.positions import rope_frequencies
    from bdh_train.storage.dcp import ShardedState

    old = tiny_model()
    adamw = torch.optim.AdamW(old.parameters())
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    old(x[:, :-1], x[:, 1:])[1].backward()
    adamw.step()
    del old._buffers["rope_freqs"]  # the model as it was before the table
    ShardedState(old, adamw).save(tmp_path / "sharded")
    new = tiny_model(seed=5)
    new.rope_freqs.zero_()
    ShardedState(new, torch.optim.AdamW(new.parameters())).load(tmp_path / "sharded")
    assert torch.equal(new.rope_freqs, rope_frequencies(new.config.n_neurons))
    for name, tensor in old.state_dict().items():
        assert torch.equal(new.state_dict()[name], tensor), name
