"""Sharded data parallel (parallel.shard = 'fsdp', FSDP2 over 2 gloo processes): 6 steps
with accumulation 2 equal one unsharded process (random windows, and streaming TBPTT with two
backward calls per micro-step), each run stopped once and resumed on the same 2 processes (at
a step boundary; one micro-step into a window); a DCP checkpoint written shard by shard by 2
processes resumes on 1 and continues as the uninterrupted run; an unsharded checkpoint and
the settings FSDP does not take are refused."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import (
    STREAMING_TBPTT_SETTINGS,
    assert_close,
    checkpoint_weights,
    run_multiprocess,
)

from bdh_train.config import load_config
from bdh_train.distributed.env import DistContext
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.train import checkpoint as ckpt
from bdh_train.train.metrics import read_metrics
from bdh_train.trainer import Trainer

BASE = [
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "model.dropout=0.0",
    "training.block_size=8",
    "training.batch_size=4",
    "training.log_every=1",
    "training.eval_every=3",
    "training.eval_steps=3",
    "training.checkpoint_every=0",
    "training.max_steps=6",
    "training.gradient_accumulation_steps=2",
    "optimizer.grad_clip_norm=0.5",
]
MODES = {
    "random-windows": BASE,
    "streaming-tbptt": [*BASE, *STREAMING_TBPTT_SETTINGS],
}
FSDP = ["parallel.shard=fsdp"]
STOP_AT_STEP = 3


def _train(run_dir: Path, overrides: list[str], rank: int = 0, world: int = 1,
           resume: bool = False, stop_after: int | None = None) -> Trainer:
    ctx = DistContext(rank, world, rank) if world > 1 else None
    trainer = Trainer(
        load_config(overrides=overrides), run_dir, resume=resume, stream=io.StringIO(),
        dist_ctx=ctx,
    )
    trainer.run(stop_after)
    return trainer


STOPS = {"random-windows": STOP_AT_STEP * 2, "streaming-tbptt": 2 * 2 + 1}
"""Micro-steps before each mode's stop: a step boundary; one micro-step into step 3."""


def _two_processes(rank: int, world: int, base: str) -> None:
    """Every mode sharded, stopped and resumed on the same 2 processes; the step-boundary
    checkpoint is also copied aside (for the 1-process resume)."""
    for mode, overrides in MODES.items():
        run = Path(base, mode, "sharded")
        trainer = _train(run, [*overrides, *FSDP], rank, world, stop_after=STOPS[mode])
        assert trainer.sharded
        if rank == 0 and STOPS[mode] % 2 == 0:
            shutil.copytree(run, Path(base, mode, "on-1"))
        dist.barrier()
        _train(run, [*overrides, *FSDP], rank, world, resume=True)
    unsharded = Path(base, "unsharded")
    _train(unsharded, [*BASE, "training.max_steps=1", "training.eval_every=0"], rank, world)
    with pytest.raises(CheckpointError, match="without parallel.shard='fsdp'"):
        Trainer(load_config(overrides=[*BASE, *FSDP]), unsharded, resume=True,
                dist_ctx=DistContext(rank, world, rank), stream=io.StringIO())


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fsdp_equals_one_process_and_its_checkpoint_resumes_on_one_process(tmp_path):
    run_multiprocess(_two_processes, tmp_path / "group2", str(tmp_path), world=2, timeout=200)
    on_one = tmp_path / "random-windows" / "on-1"
    checkpoint = ckpt.resolve_checkpoint(on_one)
    assert checkpoint.name == f"step-{STOP_AT_STEP:07d}"
    shards = sorted(p.name for p in (checkpoint / ckpt.SHARDED_DIR).iterdir())
    assert "__0_0.distcp" in shards and "__1_0.distcp" in shards  # each rank wrote its own
    _train(on_one, [*MODES["random-windows"], *FSDP], resume=True)
    # One process holds the whole model but still writes the sharded layout (DCP + weights).
    final = ckpt.resolve_checkpoint(on_one)
    assert (final / ckpt.SHARDED_DIR / ".metadata").is_file()
    assert not (final / "optimizer.pt").exists()
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        ckpt.verify_checkpoint(_damaged_copy(final, tmp_path / "damaged"))
    for mode, overrides in MODES.items():
        _train(tmp_path / mode / "reference", overrides)
        reference = tmp_path / mode / "reference"
        expected_weights, expected_losses = checkpoint_weights(reference), _losses(reference)
        assert len(expected_losses) == 6
        for run in ("sharded", "on-1") if mode == "random-windows" else ("sharded",):
            weights = checkpoint_weights(tmp_path / mode / run)
            assert weights.keys() == expected_weights.keys()
            for name, value in expected_weights.items():
                assert_close(weights[name], value, rtol=1e-5, msg=f"{mode} {run} {name}")
            losses = _losses(tmp_path / mode / run)
            assert_close(losses, expected_losses, rtol=1e-5, msg=f"{mode} {run} losses")


def test_fsdp_refuses_a_pipeline_compile_and_the_detail_profiler():
    with pytest.raises(ConfigError, match=r"parallel.shard='fsdp' .* pipeline"):
        load_config(overrides=[*BASE, *FSDP, "parallel.pipeline_stages=2"]).validate()
    with pytest.raises(ConfigError, match=r"training.compile=true"):
        load_config(overrides=[*BASE, *FSDP, "training.compile=true"]).validate()
    with pytest.raises(ConfigError, match=r"training.profile='detail'"):
        load_config(overrides=[*BASE, *FSDP, "training.profile=detail"]).validate()
    with pytest.raises(ConfigError, match=r"parallel.shard"):
        load_config(overrides=[*BASE, "parallel.shard=zero3"]).validate()


def _damaged_copy(checkpoint: Path, where: Path) -> Path:
    """A copy of `checkpoint` with one byte of a DCP shard changed."""
    shutil.copytree(checkpoint, where)
    shard = next((where / ckpt.SHARDED_DIR).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return where
