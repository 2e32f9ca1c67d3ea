"""Sharded data parallel (parallel.shard = 'fsdp', FSDP2 over 2 gloo processes): the window
gradient of a BitNet QAT model whose ranks count unequal numbers of targets equals one
process; 6 steps with accumulation 2 equal one unsharded process (random windows, and
streaming TBPTT with two backward calls per micro-step), each run stopped once and resumed
on the same 2 processes (at a step boundary; one micro-step into a window); a DCP checkpoint
written shard by shard by 2 processes resumes on 1 and continues as the uninterrupted run;
an unsharded checkpoint and the settings FSDP does not take are refused."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    DISTRIBUTED_RUN,
    STREAMING_TBPTT_SETTINGS,
    assert_close,
    checkpoint_weights,
    metric_column,
    run_multiprocess,
    tiny_model,
    train_in_group,
    unequal_count_micro_batches,
)

from bdh_train.batch import SequenceBatch
from bdh_train.config import load_config
from bdh_train.distributed import fsdp
from bdh_train.distributed.env import DistContext
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.model import QuantConfig
from bdh_train.shared.loading import load_run
from bdh_train.storage import checkpoint as ckpt
from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.reduce import accumulate_sharded
from bdh_train.train.step import LanguageTrainModel
from bdh_train.training.trainer import Trainer

# AdamW: Muon (the preset's optimizer) needs whole matrices, and these runs meet sharded ones
BASE = [*DISTRIBUTED_RUN, "optimizer.grad_clip_norm=0.5", "optimizer.name=adamw"]
MODES = {
    "random-windows": BASE,
    "streaming-tbptt": [*BASE, *STREAMING_TBPTT_SETTINGS],
}
FSDP = ["parallel.shard=fsdp"]
STOP_AT_STEP = 3


STOPS = {"random-windows": STOP_AT_STEP * 2, "streaming-tbptt": 2 * 2 + 1}
"""Micro-steps before each mode's stop: a step boundary; one micro-step into step 3."""


ROWS, BLOCK = 4, 6  # the global micro-batches of the window test; each rank takes 2 rows


def _qat_model():
    """A tiny BitNet QAT model: its quantized forward runs on the gathered weights."""
    return tiny_model(seed=1, quant=QuantConfig(enable=True))


def _window_gradients(step: LanguageTrainModel, rows: slice, group_rank: int | None):
    """The accumulated window gradient of the two micro-batches' `rows` (TBPTT chunks of 4:
    two backward calls per micro-batch): sharded when `group_rank` is set, whole otherwise."""
    model = step.model
    params = fsdp.local_parameters(model) if group_rank is not None else model
    accumulator = WeightedGradientAccumulator(params, torch.float32)
    for batch in unequal_count_micro_batches(ROWS, BLOCK):
        mine = SequenceBatch(batch.inputs[rows], batch.targets[rows])
        model.zero_grad(set_to_none=True)
        if group_rank is None:
            out = step.compute_gradients(mine)
            accumulator.accumulate_mean(None, weight=out.counted)
        else:
            accumulate_sharded(step, mine, accumulator)
    grads = accumulator.finish_mean().gradients
    if group_rank is None:
        return grads
    fsdp.write_local_gradients(grads, model)
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def _two_processes(rank: int, world: int, base: str) -> dict[str, torch.Tensor]:
    """The sharded window gradient of micro-batches with unequal counts per rank; every mode
    sharded, stopped and resumed on the same 2 processes; the step-boundary checkpoint is
    also copied aside (for the 1-process resume)."""
    model = fsdp.shard_model(_qat_model(), DistContext(rank, world, rank), "cpu")
    step = LanguageTrainModel(model, tbptt_chunk_size=4)
    gradients = _window_gradients(step, slice(2 * rank, 2 * rank + 2), rank)
    for mode, overrides in MODES.items():
        run = Path(base, mode, "sharded")
        trainer = train_in_group(run, [*overrides, *FSDP], rank, world, stop_after=STOPS[mode])
        assert trainer.sharded
        if rank == 0 and STOPS[mode] % 2 == 0:
            shutil.copytree(run, Path(base, mode, "on-1"))
        dist.barrier()
        train_in_group(run, [*overrides, *FSDP], rank, world, resume=True)
    unsharded = Path(base, "unsharded")
    train_in_group(unsharded, [*BASE, "training.max_steps=1", "training.eval_every=0"], rank, world)
    with pytest.raises(CheckpointError, match="without parallel.shard='fsdp'"):
        Trainer(
            load_config(overrides=[*BASE, *FSDP]),
            unsharded,
            resume=True,
            dist_ctx=DistContext(rank, world, rank),
            stream=io.StringIO(),
        )
    return gradients


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fsdp_equals_one_process_and_its_checkpoint_resumes_on_one_process(tmp_path):
    gradients = run_multiprocess(
        _two_processes, tmp_path / "group2", str(tmp_path), world=2, timeout=200
    )
    expected = _window_gradients(LanguageTrainModel(_qat_model(), 4), slice(0, ROWS), None)
    for rank_gradients in gradients:
        assert_close(rank_gradients, expected, rtol=1e-5, msg="unequal counts")
    on_one = tmp_path / "random-windows" / "on-1"
    checkpoint = ckpt.resolve_checkpoint(on_one)
    assert checkpoint.name == f"step-{STOP_AT_STEP:07d}"
    shards = sorted(p.name for p in (checkpoint / ckpt.SHARDED_DIR).iterdir())
    assert "__0_0.distcp" in shards and "__1_0.distcp" in shards  # each rank wrote its own
    train_in_group(on_one, [*MODES["random-windows"], *FSDP], resume=True)
    # One process holds the whole model but still writes the sharded layout (DCP + weights).
    final = ckpt.resolve_checkpoint(on_one)
    assert (final / ckpt.SHARDED_DIR / ".metadata").is_file()
    assert not (final / "optimizer.pt").exists()
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        ckpt.verify_checkpoint(_damaged_copy(final, tmp_path / "damaged"))
    # generate and eval read a sharded run through its gathered model.safetensors
    model, _, _ = load_run(tmp_path / "streaming-tbptt" / "sharded")
    assert not fsdp.is_sharded(model)
    for mode, overrides in MODES.items():
        train_in_group(tmp_path / mode / "reference", overrides)
        reference = tmp_path / mode / "reference"
        expected_weights = checkpoint_weights(reference)
        assert len(metric_column(reference, "loss")) == 6
        for run in ("sharded", "on-1") if mode == "random-windows" else ("sharded",):
            weights = checkpoint_weights(tmp_path / mode / run)
            assert weights.keys() == expected_weights.keys()
            for name, value in expected_weights.items():
                assert_close(weights[name], value, rtol=1e-5, msg=f"{mode} {run} {name}")
            for key in ("loss", "grad_norm", "val_loss"):
                assert_close(
                    metric_column(tmp_path / mode / run, key),
                    metric_column(reference, key),
                    rtol=1e-5,
                    msg=f"{mode} {run} {key}",
                )


def test_fsdp_refuses_a_pipeline_compile_and_the_detail_profiler():
    with pytest.raises(ConfigError, match=r"parallel.shard='fsdp' .* pipeline"):
        load_config(overrides=[*BASE, *FSDP, "parallel.pipeline_stages=2"]).validate()
    with pytest.raises(ConfigError, match=r"training.compile='auto'"):
        load_config(overrides=[*BASE, *FSDP, "training.compile=true"]).validate()
    with pytest.raises(ConfigError, match=r"training.compile='pointwise'"):
        load_config(overrides=[*BASE, *FSDP, "training.compile=pointwise"]).validate()
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
