"""Pipeline parallelism across real processes (gloo, CPU): pipelined training must take exactly
the optimizer steps of the single-process run, and every rank's replica must stay bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import run_multiprocess, tiny_model

from bdh_train.batch import IGNORE_INDEX, SequenceBatch
from bdh_train.distributed.config import ParallelConfig
from bdh_train.distributed.pipeline import (
    BDHStage,
    PipelineRunner,
)
from bdh_train.distributed.planner import PipelinePlan, build_pipeline_plan
from bdh_train.errors import ConfigError, DataError
from bdh_train.model import LanguageHeadConfig
from bdh_train.model.bdh import RECOMPUTE_MODES
from bdh_train.model.heads import count_targets

WORLD = 2
N_LAYER = 4
MICROBATCHES = 4
BATCH, BLOCK = 8, 6
STEPS = 3
JOIN_TIMEOUT_S = 45.0
LR = 1e-2


# ------------------------------------------------------------------ shared data
def _batch(step: int) -> SequenceBatch:
    """Deterministic batch per step, with ignored targets so the global count matters.

    The last step changes the batch shape, which makes the runner rebuild its stages (torch
    shapes the send/recv buffers on the first step).
    """
    rows, block = (BATCH, BLOCK) if step < STEPS - 1 else (MICROBATCHES, BLOCK - 1)
    gen = torch.Generator().manual_seed(100 + step)
    inputs = torch.randint(0, 32, (rows, block), generator=gen)
    targets = torch.randint(0, 32, (rows, block), generator=gen)
    targets[step % rows, : step + 2] = IGNORE_INDEX
    targets[-1, -1] = IGNORE_INDEX
    return SequenceBatch(inputs, targets)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference_run() -> dict[str, Any]:
    """The single-process run: full model, mean loss over the whole batch."""
    model = tiny_model(torch.float64, seed=0, n_layer=N_LAYER)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    snaps, losses = [], []
    for step in range(STEPS):
        batch = _batch(step)
        opt.zero_grad(set_to_none=True)
        _, loss = model(batch.inputs, batch.targets)
        loss.backward()
        opt.step()
        snaps.append(_snapshot(model))
        losses.append(loss.item())
    eval_batch = _batch(0)
    with torch.no_grad():
        hidden = model.forward_hidden(eval_batch.inputs)
        eval_sum = model.loss_from_hidden(hidden, eval_batch.targets, reduction="sum").item()
    counted = count_targets(eval_batch.targets, model.config.language_head)
    return {"snaps": snaps, "losses": losses, "eval": (eval_sum, counted)}


def _train_worker(rank: int, world: int, schedule: str, virtual: int) -> dict[str, Any]:
    """One pipeline rank: STEPS AdamW steps, recording which layers this process ran."""
    model = tiny_model(torch.float64, seed=0, n_layer=N_LAYER)
    ran_layers: set[int] = set()
    layer = model.layer

    def recording_layer(u: torch.Tensor, layer_index: int, *args: Any, **kwargs: Any):
        ran_layers.add(layer_index)
        return layer(u, layer_index, *args, **kwargs)

    model.layer = recording_layer  # type: ignore[method-assign]
    plan = build_pipeline_plan(N_LAYER, world, virtual, MICROBATCHES, schedule)
    runner = PipelineRunner(model, plan, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    snaps, losses = [], []
    for step in range(STEPS):
        losses.append(float(runner.compute_gradients(_batch(step)).loss))
        opt.step()
        snaps.append(_snapshot(model))
    layers_run = sorted(ran_layers)
    return {
        "snaps": snaps,
        "losses": losses,
        "eval": runner.eval_loss(_batch(0)),
        "layers_run": layers_run,
        "stages": len(runner.stages),
    }


# ------------------------------------------------------------------ multi-process tests
@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("schedule", "virtual"), [("gpipe", 2), ("1f1b", 1), ("interleaved_1f1b", 2)]
)
def test_pipeline_matches_single_process(schedule: str, virtual: int, tmp_path: Path) -> None:
    """Pipelined AdamW steps equal the single-process ones; replicas stay bit-identical."""
    results = run_multiprocess(
        _train_worker, tmp_path, schedule, virtual, world=WORLD, timeout=JOIN_TIMEOUT_S
    )
    ref = _reference_run()
    plan = build_pipeline_plan(N_LAYER, WORLD, virtual, MICROBATCHES, schedule)
    for rank, result in enumerate(results):
        # A real pipeline: each process ran only the layers of its own virtual stages.
        own = sorted(i for a in plan.assignments_for_rank(rank) for i in a.layer_range)
        assert result["layers_run"] == own
        assert result["stages"] == virtual
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert result["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    for step in range(STEPS):
        rank0, rank1 = (r["snaps"][step] for r in results)
        for name, expected in ref["snaps"][step].items():
            # Shared weights (encoder, encoder_v, decoder) and all others: one identical step.
            assert torch.equal(rank0[name], rank1[name]), f"step {step}: {name} differs"
            torch.testing.assert_close(
                rank0[name], expected, rtol=1e-5, atol=1e-8, msg=f"step {step}: {name}"
            )
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["eval"] == results[1]["eval"]


def _mismatch_worker(rank: int, world: int) -> str:
    """Rank 1 passes a shorter batch: both ranks must refuse it instead of hanging."""
    model = tiny_model(torch.float64, seed=0, n_layer=N_LAYER)
    runner = PipelineRunner(model, build_pipeline_plan(N_LAYER, world, 1, 4, "1f1b"), rank)
    batch = _batch(0)
    if rank == 1:
        batch = batch.time_slice(0, BLOCK - 1)
    try:
        runner.compute_gradients(batch)
    except DataError as error:
        return str(error)
    return "accepted"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_ranks_with_different_batches_refuse_together(tmp_path: Path) -> None:
    messages = run_multiprocess(_mismatch_worker, tmp_path, world=WORLD, timeout=JOIN_TIMEOUT_S)
    for message in messages:
        assert "every rank of a pipeline must pass the same batch" in message


# ------------------------------------------------------------------ in-process tests
def test_stages_compose_to_the_full_forward() -> None:
    """Chaining the stages of a plan gives the model's own hidden states."""
    model = tiny_model(torch.float64, seed=3, n_layer=N_LAYER)
    plan = build_pipeline_plan(N_LAYER, 2, 2, MICROBATCHES, "interleaved_1f1b")
    idx = _batch(0).inputs
    x: torch.Tensor = idx
    for a in plan.assignments:
        x = BDHStage(model, a.layer_range, is_first=a.virtual_stage_id == 0)(x)
    torch.testing.assert_close(x, model.forward_hidden(idx), rtol=0, atol=1e-12)


def _plan(schedule: str = "1f1b", virtual: int = 1, microbatches: int = 4) -> PipelinePlan:
    return build_pipeline_plan(N_LAYER, 2, virtual, microbatches, schedule)


def test_pipeline_shape_rules_are_refused_by_the_plan() -> None:
    """The runner takes plans from build_pipeline_plan, which checks the shape rules once."""
    with pytest.raises(ConfigError, match="model.n_layer"):
        build_pipeline_plan(3, 2, 2, 4, "interleaved_1f1b")
    for schedule, virtual in (("1f1b", 1), ("interleaved_1f1b", 2)):
        with pytest.raises(ConfigError, match="parallel.microbatches"):
            build_pipeline_plan(N_LAYER, 2, virtual, 1, schedule)
    with pytest.raises(ConfigError, match="parallel.virtual_stages_per_rank=2 needs"):
        build_pipeline_plan(N_LAYER, 2, 2, 4, "1f1b")


def test_batch_size_must_split_into_equal_microbatches() -> None:
    runner_rules = ParallelConfig(2, 1, 4, "1f1b").validate()
    with pytest.raises(ConfigError, match="training.batch_size=6 .*parallel.microbatches=4"):
        runner_rules.check_training(6, 0, False)
    with pytest.raises(ConfigError, match="parallel.microbatches must be <= training.batch_size"):
        runner_rules.check_training(2, 0, False)
    runner_rules.check_training(8, 0, False)
    with pytest.raises(ConfigError, match="parallel.microbatches=5 must be a multiple"):
        ParallelConfig(2, 2, 5, "interleaved_1f1b").validate().check_training(10, 0, False)


def test_runner_needs_a_process_group() -> None:
    assert not dist.is_initialized(), "an earlier test leaked a default process group"
    with pytest.raises(ConfigError, match="process group"):
        PipelineRunner(tiny_model(n_layer=N_LAYER), _plan(), 0)


@pytest.mark.timeout(90)
def test_runner_refuses_group_size_mismatch(single_process_group: None) -> None:
    with pytest.raises(ConfigError, match="parallel.pipeline_stages=2 must equal"):
        PipelineRunner(tiny_model(n_layer=N_LAYER), _plan(), 0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_single_stage_runner(single_process_group: None, recompute: str) -> None:
    """One stage: the schedule degenerates to microbatched accumulation and must equal the
    full-batch mean-loss gradient (of a model that keeps every activation, whatever the
    runner's model recomputes); an indivisible batch is refused before any traffic."""
    model = tiny_model(torch.float64, seed=0, n_layer=N_LAYER)
    model.set_recompute(recompute)
    reference = tiny_model(torch.float64, seed=0, n_layer=N_LAYER)
    runner = PipelineRunner(model, build_pipeline_plan(N_LAYER, 1, 1, MICROBATCHES, "gpipe"), 0)
    batch = _batch(0)
    loss = float(runner.compute_gradients(batch).loss)
    _, ref_loss = reference(batch.inputs, batch.targets)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-5, atol=1e-10, msg=name)
    with pytest.raises(ConfigError, match="training.batch_size=6"):
        runner.compute_gradients(batch.rows(0, 6))


@pytest.mark.timeout(90)
def test_runner_weights_by_what_the_head_counts(single_process_group: None) -> None:
    """NCA head, targets with id 19 (neither patch nor special): the runner's loss, gradient
    and weight are the head's own mean and count, not the count of non-ignored targets."""
    head = LanguageHeadConfig(
        type="nca_factorized_patch",
        state_count=2,
        patch_size=2,
        frame_special_tokens=True,
        eos_id=18,
    )
    model = tiny_model(torch.float64, seed=0, n_layer=2, vocab_size=20, language_head=head)
    reference = tiny_model(torch.float64, seed=0, n_layer=2, vocab_size=20, language_head=head)
    runner = PipelineRunner(model, build_pipeline_plan(2, 1, 1, 2, "gpipe"), 0)
    inputs = torch.tensor([[16, 0, 1, 17, 16, 2], [16, 4, 5, 17, 16, 6]])
    targets = torch.tensor([[0, 1, 17, 19, 2, IGNORE_INDEX], [4, 19, 17, 18, 6, 19]])
    out = runner.compute_gradients(SequenceBatch(inputs, targets))
    _, ref_loss = reference(inputs, targets)
    ref_loss.backward()
    assert out.counted == 8  # 12 targets - 1 ignored - 3 of id 19
    assert float(out.loss) == pytest.approx(ref_loss.item(), rel=1e-12)
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-10, atol=1e-14, msg=name)
    loss_sum, counted = runner.eval_loss(SequenceBatch(inputs, targets))
    assert counted == 8 and loss_sum / counted == pytest.approx(ref_loss.item(), rel=1e-12)
