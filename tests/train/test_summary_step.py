"""The summary event mask through the batch and the train step: every path (full, TBPTT
chunks, pipeline microbatches, valid, streaming) equals the full pass with the mask."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.batch import IGNORE_INDEX, SequenceBatch
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.train.step import LanguageTrainModel

GATED = SummaryMemoryConfig(
    enabled=True,
    chunk_tokens=3,
    write_gate=True,
    surprise_gate_threshold=0.3,
    surprise_gate_sharpness=2.0,
    residual_scale=1.0,
)


def gated_model(**overrides):
    return tiny_model(summary_memory=GATED, **overrides)


def masked_batch(b=2, t=12, seed=0, vocab=32):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (b, t), generator=g)
    targets = torch.randint(0, vocab, (b, t), generator=g)
    targets[0, 1] = IGNORE_INDEX
    mask = (torch.rand(b, t, generator=g) < 0.3).long()
    return SequenceBatch(inputs, targets, summary_event_mask=mask)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def full_pass(model, b):
    """The slow twin: one forward over the whole block with the whole mask."""
    model.zero_grad(set_to_none=True)
    hidden = model.forward_hidden(b.inputs, summary_event_mask=b.summary_event_mask)
    loss = model.loss_from_hidden(hidden, b.targets)
    loss.backward()
    return loss.detach(), grads_of(model)


# ------------------------------------------------------------------ the batch
def test_batch_carries_the_mask_through_to_rows_and_time_slice():
    b = masked_batch(b=4, t=6)
    assert torch.equal(b.to("cpu").summary_event_mask, b.summary_event_mask)
    assert torch.equal(b.rows(1, 3).summary_event_mask, b.summary_event_mask[1:3])
    assert torch.equal(b.time_slice(2, 5).summary_event_mask, b.summary_event_mask[:, 2:5])
    assert SequenceBatch(b.inputs, b.targets).rows(0, 1).summary_event_mask is None
    with pytest.raises(ValueError, match=r"summary_event_mask must have the inputs' shape"):
        SequenceBatch(b.inputs, b.targets, summary_event_mask=torch.zeros(4, 5))


# ------------------------------------------------------------------ TBPTT
@pytest.mark.parametrize("chunk", [3, 5])  # a multiple of chunk_tokens, and not
def test_tbptt_with_the_mask_equals_the_full_pass(chunk):
    model = gated_model()
    b = masked_batch()
    full_loss, full_grads = full_pass(model, b)
    n_chunks = -(-12 // chunk)
    step = LanguageTrainModel(model, tbptt_chunk_size=chunk, tbptt_backprop_chunks=n_chunks)
    assert abs(step.valid_step(b) - full_loss) / full_loss < 1e-5
    out = step.train_step(b)
    assert abs(out.loss - full_loss) / full_loss < 1e-5
    assert_close(grads_of(model), full_grads, rtol=1e-5)
    # the mask matters on this path (so the equalities above are not vacuous)
    unmasked = SequenceBatch(b.inputs, b.targets)
    assert abs(step.valid_step(unmasked) - full_loss) > 1e-4


# ------------------------------------------------------------------ pipeline emulation
@pytest.mark.parametrize(("virtual", "schedule"), [(1, "gpipe"), (2, "interleaved_1f1b")])
def test_pipeline_microbatches_with_the_mask_equal_the_full_batch(virtual, schedule):
    model = gated_model(n_layer=4)
    plan = build_pipeline_plan(4, 2, virtual, 2, schedule)
    b = masked_batch(b=4, t=7)
    full_loss, full_grads = full_pass(model, b)
    step = LanguageTrainModel(model, pipeline_plan=plan)
    assert abs(step.valid_step(b) - full_loss) / full_loss < 1e-5
    out = step.train_step(b)
    assert abs(out.loss - full_loss) / full_loss < 1e-5
    assert_close(grads_of(model), full_grads, rtol=1e-5)


# ------------------------------------------------------------------ streaming
def test_streaming_reset_row_restarts_its_summary_memory_only():
    """Two streamed blocks of 5 tokens (not a multiple of chunk_tokens: chunks span blocks);
    row 1 is reset before the second. Row 0 equals one pass over both blocks, row 1 a fresh
    pass over the second."""
    model = gated_model()
    step = LanguageTrainModel(model, streaming=True)
    first, second = masked_batch(t=5, seed=1), masked_batch(t=5, seed=2)
    first.reset = torch.tensor([True, True])
    second.reset = torch.tensor([False, True])
    step.train_step(first)
    step.train_step(second)
    carried = step.carried_state
    with torch.no_grad():
        state0 = model.init_state(1)
        model.forward_hidden(
            torch.cat([first.inputs[:1], second.inputs[:1]], 1),
            state0,
            summary_event_mask=torch.cat(
                [first.summary_event_mask[:1], second.summary_event_mask[:1]], 1
            ),
        )
        state1 = model.init_state(1)
        model.forward_hidden(
            second.inputs[1:], state1, summary_event_mask=second.summary_event_mask[1:]
        )
    for layer in range(2):
        for got, row0, row1 in zip(
            carried.summary[layer], state0.summary[layer], state1.summary[layer], strict=True
        ):
            assert_close(got[:1], row0, rtol=1e-5, atol=1e-7)
            assert_close(got[1:], row1, rtol=1e-5, atol=1e-7)
    assert carried.position.tolist() == [10, 5]


def test_carried_summary_memory_round_trips_through_the_step_state_dict():
    step = LanguageTrainModel(gated_model(), streaming=True)
    step.train_step(masked_batch(t=4))
    other = LanguageTrainModel(gated_model(), streaming=True)
    other.load_state_dict(step.state_dict())
    for got, ref in zip(other.carried_state.summary[1], step.carried_state.summary[1], strict=True):
        assert torch.equal(got, ref)


# ------------------------------------------------------------------ summary memory off
@pytest.mark.parametrize("options", [{}, {"tbptt_chunk_size": 5}, {"streaming": True}])
def test_a_mask_with_summary_memory_off_has_no_effect(options):
    b = masked_batch()
    plain = SequenceBatch(b.inputs, b.targets)
    results = []
    for batch_ in (b, plain):
        model = tiny_model()
        step = LanguageTrainModel(model, **options)
        out = step.train_step(batch_)
        results.append((out.loss, grads_of(model), step.valid_step(batch_)))
    (loss, grads, valid), (loss_ref, grads_ref, valid_ref) = results
    assert torch.equal(loss, loss_ref) and torch.equal(valid, valid_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
