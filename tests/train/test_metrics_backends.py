"""Metrics backends: TensorBoard event files and the W&B offline run hold the rows of
metrics.jsonl (read back with each tool's own reader), and report_to is checked up front."""

from __future__ import annotations

import io
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from bdh_train.config import load_config
from bdh_train.errors import ConfigError
from bdh_train.storage.run_dir import TENSORBOARD_DIR
from bdh_train.train import metrics as metrics_module
from bdh_train.train.metrics import read_metrics, scalars
from bdh_train.training.trainer import Trainer

TINY = [
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=2",
    "training.block_size=8",
    "training.batch_size=2",
    "training.log_every=1",
    "training.eval_every=2",
    "training.eval_steps=1",
    "training.max_steps=4",
]


def _train(run_dir: Path, *overrides: str, resume: bool = False) -> None:
    cfg = load_config(overrides=[*TINY, *overrides])
    Trainer(cfg, run_dir, resume=resume, resume_fallback=resume, stream=io.StringIO()).run()


def _tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[tuple[str, int], list[float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault((tag, event.step), []).append(event.value)
    return out


def _jsonl_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    return {
        (key, row["step"]): value
        for row in read_metrics(run_dir / "metrics.jsonl")
        for key, value in scalars(row).items()
    }


def test_tensorboard_events_hold_the_metrics_rows_once_across_a_resume(tmp_path):
    both = 'metrics.report_to=["jsonl", "tensorboard"]'
    _train(tmp_path, both, "training.checkpoint_every=2")
    shutil.rmtree(tmp_path / "checkpoints" / "step-0000004")  # as if killed after step 4
    _train(tmp_path, both, "training.checkpoint_every=2", resume=True)  # steps 3, 4 again
    expected = _jsonl_scalars(tmp_path)
    assert {"loss", "lr", "grad_norm", "val_loss", "bits_per_byte"} <= {k for k, _ in expected}
    assert {step for _, step in expected} == {1, 2, 3, 4}
    got = _tensorboard_scalars(tmp_path)  # the first run's steps 3 and 4 purged
    assert got.keys() == expected.keys()
    for key, value in expected.items():  # one event each; event files store float32
        assert got[key] == [np.float32(value)], key


def _wandb_summary(run_dir: Path) -> dict[str, object]:
    """The summary of the offline W&B run in `run_dir`: its summary records folded in order.
    The run file is a LevelDB-style log (7-byte header; 32 KiB blocks of records with a
    7-byte header: CRC, length, kind), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, block, pending, summary = path.read_bytes(), 7, 1 << 15, b"", {}
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "summary":
                for item in record.summary.update:
                    key = item.key or item.nested_key[-1]
                    summary[key] = json.loads(item.value_json)
    return summary


def test_wandb_offline_summary_holds_the_final_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    _train(tmp_path, 'metrics.report_to=["wandb"]')
    import wandb

    wandb.teardown()  # the client's service writes the run file out when it stops
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    summary = _wandb_summary(tmp_path)
    assert summary["loss"] == rows[-1]["loss"]
    assert summary["_step"] == 4


def test_report_to_is_checked_before_anything_runs(monkeypatch):
    with pytest.raises(ConfigError, match=r"metrics.report_to\[\] must be one of"):
        load_config(overrides=['metrics.report_to=["tensorbord"]'])
    monkeypatch.setattr(metrics_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="'wandb' package is not installed: pip install wandb"):
        load_config(overrides=['metrics.report_to=["wandb"]'])
