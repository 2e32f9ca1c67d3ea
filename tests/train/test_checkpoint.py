"""Checkpoint directories as a database keeps them: pruned by step, never losing `latest` or
the one just written, re-saved by swapping, recovered after a crash, verified by SHA-256."""

from __future__ import annotations

from pathlib import Path

import pytest

from bdh_train.errors import CheckpointError
from bdh_train.train import checkpoint as ckpt


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
