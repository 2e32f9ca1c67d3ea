"""The summary event mask across real pipeline processes (gloo, CPU): every stage slices the
mask per microbatch, so pipelined gradients equal the single-process full pass with the mask."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_close, run_multiprocess, tiny_model

from bdh_train.batch import SequenceBatch
from bdh_train.distributed.pipeline import PipelineRunner
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.heads import count_targets

N_LAYER, MICROBATCHES = 4, 4
GATED = SummaryMemoryConfig(
    enabled=True,
    chunk_tokens=2,
    write_gate=True,
    residual_scale=1.0,
    surprise_gate_threshold=0.3,
    surprise_gate_sharpness=2.0,
)


def _model() -> torch.nn.Module:
    return tiny_model(torch.float64, seed=0, n_layer=N_LAYER, summary_memory=GATED)


def _batch(masked: bool = True) -> SequenceBatch:
    g = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, 32, (8, 7), generator=g)
    targets = torch.randint(0, 32, (8, 7), generator=g)
    mask = (torch.rand(8, 7, generator=g) < 0.3).long()
    return SequenceBatch(inputs, targets, summary_event_mask=mask if masked else None)


def _worker(rank: int, world: int, schedule: str, virtual: int) -> dict[str, Any]:
    model = _model()
    plan = build_pipeline_plan(N_LAYER, world, virtual, MICROBATCHES, schedule)
    runner = PipelineRunner(model, plan, rank)
    loss = float(runner.compute_gradients(_batch()).loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss, "grads": grads, "eval": runner.eval_loss(_batch())}


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
# The interleaved schedule (the most reordering); every schedule runs without the memory
# in test_pipeline_mp.py.
@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved_1f1b", 2)])
def test_pipeline_with_the_mask_equals_the_full_pass(
    schedule: str, virtual: int, tmp_path: Path
) -> None:
    results = run_multiprocess(_worker, tmp_path, schedule, virtual, world=2, timeout=45.0)
    model, b = _model(), _batch()
    hidden = model.forward_hidden(b.inputs, summary_event_mask=b.summary_event_mask)
    loss = model.loss_from_hidden(hidden, b.targets)
    loss.backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for result in results:
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-10)
        counted = count_targets(b.targets, model.config.language_head)
        assert result["eval"][0] == pytest.approx(loss.item() * counted, rel=1e-10)
        assert_close(result["grads"], expected, rtol=1e-10)
    # without the mask the write gate never opens: a different loss (the mask really travels)
    unmasked = _model()
    _, other = unmasked(b.inputs, b.targets)
    assert abs(other.item() - loss.item()) > 1e-4
