"""Data parallel x pipeline parallel on a 2 x 2 device mesh (4 gloo processes): the
token-weighted gradient of replicas with unequal token counts, and 6 trainer steps with
accumulation 2, equal one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    DISTRIBUTED_RUN,
    assert_close,
    checkpoint_weights,
    metric_column,
    run_multiprocess,
    tiny_model,
    train_in_group,
    unequal_count_micro_batches,
)

from bdh_train.batch import IGNORE_INDEX, SequenceBatch
from bdh_train.config import load_config
from bdh_train.distributed.config import ParallelConfig
from bdh_train.distributed.env import DistContext, pipeline_mesh
from bdh_train.distributed.pipeline import PipelineRunner
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.errors import ConfigError
from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.reduce import all_reduce_accumulated

REPLICAS, STAGES = 2, 2
ROWS, BLOCK = 4, 6  # the global batch; each replica takes 2 rows


def _mesh_gradients(rank: int, world: int) -> dict[str, torch.Tensor]:
    mesh = pipeline_mesh(DistContext(rank, world, rank), "cpu", REPLICAS, STAGES)
    model = tiny_model(seed=1)
    plan = build_pipeline_plan(model.config.n_layer, STAGES, 1, 2, "1f1b")
    runner = PipelineRunner(model, plan, mesh.stage, mesh.stage_group)
    accumulator = WeightedGradientAccumulator(model, torch.float32)
    rows = slice(mesh.data.rank * 2, mesh.data.rank * 2 + 2)
    for batch in unequal_count_micro_batches(ROWS, BLOCK):
        mine = SequenceBatch(batch.inputs[rows], batch.targets[rows])
        model.zero_grad(set_to_none=True)
        out = runner.compute_gradients(mine)
        accumulator.accumulate_mean(None, weight=out.counted)
    return all_reduce_accumulated(
        accumulator.finish_sums(), model.named_parameters(), mesh.data.group
    )


TRAIN = DISTRIBUTED_RUN
MESH = ["parallel.pipeline_stages=2", "parallel.data_parallel=2", "parallel.microbatches=2"]


def _mesh_worker(rank: int, world: int, base: str) -> dict[str, torch.Tensor]:
    train_in_group(Path(base, "mesh"), [*TRAIN, *MESH], rank, world)
    return _mesh_gradients(rank, world)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_by_two_mesh_equals_one_process(tmp_path):
    results = run_multiprocess(
        _mesh_worker, tmp_path / "group", str(tmp_path), world=REPLICAS * STAGES, timeout=180
    )
    # the exact token-weighted gradient: the mean over every counted target of both windows
    model = tiny_model(seed=1)
    batches = unequal_count_micro_batches(ROWS, BLOCK)
    loss_sum = sum(
        model.loss_from_hidden(model.forward_hidden(b.inputs), b.targets, reduction="sum")
        for b in batches
    )
    counted = sum(int((b.targets != IGNORE_INDEX).sum()) for b in batches)
    (loss_sum / counted).backward()
    for rank, grads in enumerate(results):
        for name, param in model.named_parameters():
            assert_close(grads[name], param.grad, rtol=1e-5, msg=f"rank {rank} {name}")
    # the trainer on the mesh: parameters and validation loss after 6 steps
    one = tmp_path / "one"
    train_in_group(one, TRAIN)
    expected, got = checkpoint_weights(one), checkpoint_weights(tmp_path / "mesh")
    for name, value in expected.items():
        assert_close(got[name], value, rtol=1e-5, msg=name)
    assert_close(
        metric_column(tmp_path / "mesh", "val_loss")[-1],
        metric_column(one, "val_loss")[-1],
        rtol=1e-5,
        msg="val_loss",
    )


def test_mesh_shape_follows_the_process_count():
    assert ParallelConfig(pipeline_stages=2).mesh_shape(4) == (2, 2)
    assert ParallelConfig(pipeline_stages=2, emulate=True).mesh_shape(3) == (3, 1)
    assert ParallelConfig().mesh_shape(3) == (3, 1)
    with pytest.raises(ConfigError, match="needs a multiple of 2 processes"):
        ParallelConfig(pipeline_stages=2).mesh_shape(3)
    with pytest.raises(ConfigError, match=r"data_parallel=2 x parallel.pipeline_stages=2 needs 4"):
        ParallelConfig(pipeline_stages=2, data_parallel=2).mesh_shape(2)
    with pytest.raises(ConfigError, match="does not split over parallel.data_parallel=3"):
        load_config(overrides=[*TRAIN, *MESH, "parallel.data_parallel=3"])
