"""The language train step against its slow twins."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from helpers import assert_close, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from bdh_train.batch import IGNORE_INDEX, SequenceBatch
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.model import LanguageHeadConfig, QuantConfig, groups
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.train import profile as profile_module
from bdh_train.train.profile import (
    PROBES,
    MemoryReading,
    NullProfiler,
    ProfileSettings,
    StepProfile,
    StepProfiler,
    profile_row,
)
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.step import LanguageTrainModel, _columns

SEED_INPUTS = torch.tensor([[0, 1, 2, 3], [7, 6, 5, 4]])
SEED_TARGETS = torch.tensor([[1, 2, 3, 4], [6, 5, 4, 3]])


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def batch(b=2, t=12, seed=0, vocab=32):
    g = torch.Generator().manual_seed(seed)
    return SequenceBatch(
        torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)
    )


def full_gradients(model, batch_):
    model.zero_grad(set_to_none=True)
    hidden = model.forward_hidden(batch_.inputs)
    loss = model.loss_from_hidden(hidden, batch_.targets)
    loss.backward()
    return loss.detach(), grads_of(model)


# ------------------------------------------------------------------ TBPTT
def test_tbptt_valid_loss_equals_full_loss_seed_case():
    model = tiny_model(n_layer=2, n_embd=8, n_head=1, mlp_internal_dim_multiplier=1, vocab_size=16)
    b = SequenceBatch(SEED_INPUTS, SEED_TARGETS)
    full = LanguageTrainModel(model).valid_step(b)
    chunked = LanguageTrainModel(model, tbptt_chunk_size=2).valid_step(b)
    assert abs(full - chunked) < 1e-5


@pytest.mark.parametrize("chunk", [1, 5, 7])
def test_tbptt_train_loss_equals_full_loss_and_full_backprop_grads(chunk):
    model = tiny_model(position="rope")
    b = batch()
    full_loss, full_grads = full_gradients(model, b)
    n_chunks = -(-12 // chunk)
    step = LanguageTrainModel(model, tbptt_chunk_size=chunk, tbptt_backprop_chunks=n_chunks)
    out = step.train_step(b)
    assert abs(out.loss - full_loss) / full_loss < 1e-5
    for name, g in grads_of(model).items():
        assert_close(g, full_grads[name], rtol=1e-5, msg=name)


def test_tbptt_k1_equals_hand_written_detaching_loop():
    model = tiny_model(position="alibi")
    b = batch(t=10)
    # the slow twin: chunk, forward, backward, detach, by hand
    model.zero_grad(set_to_none=True)
    state = model.init_state(2)
    for start in range(0, 10, 4):
        end = min(start + 4, 10)
        hidden = model.forward_hidden(b.inputs[:, start:end], state)
        loss = model.loss_from_hidden(hidden, b.targets[:, start:end]) * (end - start) / 10
        loss.backward()
        state.detach_()
    expected = grads_of(model)
    LanguageTrainModel(model, tbptt_chunk_size=4).train_step(b)
    for name, g in grads_of(model).items():
        assert_close(g, expected[name], rtol=1e-5, msg=name)


def test_tbptt_k2_lets_gradient_cross_one_boundary():
    """k=2 of 3 chunks: differs from both k=1 and full backprop (so k is really used), and
    equals a hand-written loop that detaches only after chunk 2."""
    model = tiny_model(position="rope")
    b = batch(t=9)
    model.zero_grad(set_to_none=True)
    state = model.init_state(2)
    h1 = model.forward_hidden(b.inputs[:, :3], state)
    h2 = model.forward_hidden(b.inputs[:, 3:6], state)
    loss = (
        model.loss_from_hidden(h1, b.targets[:, :3], "sum")
        + model.loss_from_hidden(h2, b.targets[:, 3:6], "sum")
    ) / 18
    loss.backward()
    state.detach_()
    h3 = model.forward_hidden(b.inputs[:, 6:], state)
    (model.loss_from_hidden(h3, b.targets[:, 6:], "sum") / 18).backward()
    expected = grads_of(model)
    LanguageTrainModel(model, tbptt_chunk_size=3, tbptt_backprop_chunks=2).train_step(b)
    got = grads_of(model)
    for name in expected:
        assert_close(got[name], expected[name], rtol=1e-5, msg=name)
    LanguageTrainModel(model, tbptt_chunk_size=3, tbptt_backprop_chunks=1).train_step(b)
    with pytest.raises(AssertionError, match="exceeds"):  # 1 backprop chunk, not 2: differs
        assert_close(grads_of(model)["encoder"], expected["encoder"], rtol=1e-4)


def test_ignored_targets_are_not_counted_in_chunk_weights():
    model = tiny_model()
    b = batch(t=8)
    b.targets[0, :5] = IGNORE_INDEX
    full_loss, full_grads = full_gradients(model, b)
    out = LanguageTrainModel(model, tbptt_chunk_size=3, tbptt_backprop_chunks=3).train_step(b)
    assert out.counted == 11
    assert abs(out.loss - full_loss) / full_loss < 1e-5
    for name, g in grads_of(model).items():
        assert_close(g, full_grads[name], rtol=1e-5, msg=name)


def test_tbptt_train_step_seed_case_is_finite():
    """The reference's seed case (chunks of 2, one backward per chunk): a finite loss that is
    the full forward's mean loss, and the gradients of the hand-written detaching loop."""
    model = tiny_model(n_layer=2, n_embd=8, n_head=1, mlp_internal_dim_multiplier=1, vocab_size=16)
    b = SequenceBatch(SEED_INPUTS, SEED_TARGETS)
    full_loss, _ = full_gradients(model, b)
    model.zero_grad(set_to_none=True)
    state = model.init_state(2)
    for start in (0, 2):  # the slow twin: forward, backward, detach per chunk
        hidden = model.forward_hidden(b.inputs[:, start : start + 2], state)
        (model.loss_from_hidden(hidden, b.targets[:, start : start + 2], "sum") / 8).backward()
        state.detach_()
    expected = grads_of(model)
    out = LanguageTrainModel(model, tbptt_chunk_size=2).train_step(b)
    assert torch.isfinite(out.loss) and out.counted == 8
    assert abs(float(out.loss) - float(full_loss)) < 1e-6 * float(full_loss)
    assert_close(grads_of(model), expected, rtol=1e-5, msg="seed-case TBPTT gradients")


LOW_BIT_CASES = {  # the reference's three low-bit cases, each run through chunked TBPTT
    "partial_safe_qat": dict(target_modules=["encoder", "decoder_y"]),
    "train_kernel": dict(target_modules=["encoder", "decoder_y"], training_mode="train_kernel"),
    "train_kernel_saved_int8": dict(
        target_modules=["encoder", "decoder_y"],
        training_mode="train_kernel",
        saved_activations="quantized_cache_recompute",
    ),
}


def backprop_through_chunks(model, batch_, chunk_size):
    """Gradients of the mean loss with the block read `chunk_size` tokens per call, the state
    carried from call to call without being detached, and one backward: full backprop, by the
    same products as a chunked TBPTT step."""
    model.zero_grad(set_to_none=True)
    state = model.init_state(batch_.inputs.shape[0])
    total = 0.0
    for start in range(0, batch_.inputs.shape[1], chunk_size):
        hidden = model.forward_hidden(batch_.inputs[:, start : start + chunk_size], state)
        total = total + model.loss_from_hidden(
            hidden, batch_.targets[:, start : start + chunk_size], "sum"
        )
    loss = total / batch_.targets.numel()
    loss.backward()
    return loss.detach(), grads_of(model)


@pytest.mark.parametrize("case", sorted(LOW_BIT_CASES))
def test_quantized_tbptt_with_all_chunks_in_one_backward_is_backprop_through_the_chunks(case):
    """QAT and TBPTT together: int8 activations are quantized per token and ternary weights
    per tensor, so cutting the block into chunks changes nothing; with one backward over all
    chunks the loss and gradients are those of backprop through the same chunks undetached:
    1e-10 in float64. The reference reads the block in the same chunks because a relu after
    a quantized projection is discontinuous where its codes cancel exactly: the float sum of
    the dequantized terms is then +-1e-17 or 0 by the BLAS's order of summation, which varies
    with the product's shape (T=10 against T=3 flipped such masks with MKL on an AMD EPYC)."""
    quant = QuantConfig(
        enable=True, weight_format="ternary158", act_format="int8", **LOW_BIT_CASES[case]
    )
    model = tiny_model(torch.float64, quant=quant)
    b = batch(t=10, seed=6)
    full_loss, full_grads = backprop_through_chunks(model, b, 3)
    out = LanguageTrainModel(model, tbptt_chunk_size=3, tbptt_backprop_chunks=4).train_step(b)
    assert abs(float(out.loss) - float(full_loss)) < 1e-6 * float(full_loss)  # float32 report
    assert_close(grads_of(model), full_grads, rtol=1e-10, msg=case)
    float_model = tiny_model(torch.float64)
    _, float_grads = backprop_through_chunks(float_model, b, 3)
    with pytest.raises(AssertionError, match="exceeds"):  # quantization really is in the path
        assert_close(full_grads, float_grads, rtol=1e-3)


# ------------------------------------------------------------------ what the head counts
NCA_HEAD = LanguageHeadConfig(
    type="nca_factorized_patch", state_count=2, patch_size=2, frame_special_tokens=True, eos_id=18
)


@pytest.mark.parametrize(
    "setup",
    [{}, {"tbptt_chunk_size": 3, "tbptt_backprop_chunks": 3}, {"pipeline": True}],
    ids=["full", "tbptt", "pipeline"],
)
def test_nca_step_loss_and_weight_are_the_heads_own(setup):
    """Target 19 is neither a patch id (< 16) nor a special (16, 17, 18): the head neither
    scores nor counts it, so the step must divide by the head's count (6 here), not by the
    8 non-ignored targets."""
    model = tiny_model(torch.float64, vocab_size=20, language_head=NCA_HEAD)
    inputs = torch.tensor([[16, 0, 1, 17, 16, 2, 3, 18], [16, 4, 5, 17, 16, 6, 7, 18]])
    targets = torch.tensor([[0, 1, 17, 19, 2, 3, 16, IGNORE_INDEX], [4, 19, 17, 18, 6, 7, 16, 19]])
    b = SequenceBatch(inputs, targets)
    with torch.no_grad():
        _, model_loss = model(inputs, targets)
    kwargs = dict(setup)
    if kwargs.pop("pipeline", False):
        kwargs["pipeline_plan"] = build_pipeline_plan(2, 2, 1, 2, "gpipe")
    step = LanguageTrainModel(model, **kwargs)
    out = step.train_step(b)
    assert out.counted == 12  # 16 targets - 1 ignored - 3 of id 19
    expected_loss = float(model_loss)  # the step reports float32 losses: 1e-6 relative
    assert abs(float(out.loss) - expected_loss) < 1e-6 * expected_loss
    assert abs(float(step.valid_step(b)) - expected_loss) < 1e-6 * expected_loss
    loss_sum, counted = step.eval_loss(b)
    assert counted == 12 and abs(loss_sum / counted - expected_loss) < 1e-6 * expected_loss
    model.zero_grad(set_to_none=True)
    model(inputs, targets)[1].backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    step.train_step(b)
    assert_close(grads_of(model), expected, rtol=1e-10, msg="grads of the head's mean loss")


# ------------------------------------------------------------------ streaming
def test_streaming_second_step_equals_direct_forward_from_carried_state():
    model = tiny_model()
    step = LanguageTrainModel(model, streaming=True)
    first = SequenceBatch(torch.tensor([[0, 1]]), torch.tensor([[1, 2]]), torch.tensor([True]))
    second = SequenceBatch(torch.tensor([[2, 3]]), torch.tensor([[3, 4]]), torch.tensor([False]))
    step.train_step(first)
    carried = step.carried_state.clone()
    assert carried.position.tolist() == [2]
    with torch.no_grad():
        _, expected = model(second.inputs, second.targets, carried)
    loss = step.train_step(second).loss
    assert abs(loss - expected) < 1e-5
    assert step.carried_state.position.tolist() == [4]


def test_streaming_reset_row_is_fresh_while_other_row_continues():
    """Row 0 continues from its carried state; row 1, flagged, starts from zero at position 0.
    Checked per row on what the step itself produces: its loss (with the other row's targets
    ignored, so the loss is this row's alone) and the state it carries on, against each row
    run on its own (row 0 from its carried state, row 1 from a fresh one)."""
    model = tiny_model()
    step = LanguageTrainModel(model, streaming=True)
    a = batch(b=2, t=3, seed=1)
    a.reset = torch.tensor([True, True])
    step.train_step(a)
    carried = step.carried_state.clone()
    assert carried.position.tolist() == [3, 3] and all(r.abs().sum() > 0 for r in carried.rho)
    b = batch(b=2, t=3, seed=2)
    b.reset = torch.tensor([False, True])
    alone = [_row(carried, 0), model.init_state(1)]  # the slow twin: each row on its own
    expected = []
    with torch.no_grad():
        for row, state in enumerate(alone):
            hidden = model.forward_hidden(b.inputs[row : row + 1], state)
            expected.append(float(model.loss_from_hidden(hidden, b.targets[row : row + 1])))
    for row in (0, 1):
        step.carried_state = carried.clone()
        targets = b.targets.clone()
        targets[1 - row] = IGNORE_INDEX
        out = step.train_step(SequenceBatch(b.inputs, targets, b.reset))
        assert abs(float(out.loss) - expected[row]) < 1e-6 * expected[row], f"row {row} loss"
        state = step.carried_state
        assert state.position.tolist() == [6, 3]  # positions advance per row
        for layer, rho in enumerate(state.rho):
            assert_close(rho[row], alone[row].rho[layer][0], rtol=1e-6, msg=f"row {row} rho")


def _row(state, row):
    out = state.clone()
    out.position = out.position[row : row + 1]
    out.rho = [r[row : row + 1] for r in out.rho]
    return out


def test_streaming_reset_of_whole_batch_matches_fresh_forward():
    model = tiny_model()
    step = LanguageTrainModel(model, streaming=True)
    step.train_step(
        SequenceBatch(torch.tensor([[0, 1]]), torch.tensor([[1, 2]]), torch.tensor([True]))
    )
    second = SequenceBatch(torch.tensor([[2, 3]]), torch.tensor([[3, 4]]), torch.tensor([True]))
    with torch.no_grad():
        _, expected = model(second.inputs, second.targets)
    assert abs(step.train_step(second).loss - expected) < 1e-5
    assert step.carried_state.position.tolist() == [2]


# Two rows streamed over two blocks of 8 tokens in TBPTT chunks of 3 (absolute chunk starts
# 0, 3, 6 | 8, 11, 14). Documents start (at an input) on a chunk's first token (3, 8, 14),
# inside a chunk (5, 10) and at the stream's start.
DOC_STARTS = ({0, 3, 10}, {0, 5, 8, 14})
DOC_BLOCK, DOC_CHUNK = 8, 3


def _document_stream(vocab: int = 32):
    """Inputs [2, 16], targets (a document's first token is never a target) and resets."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (2, 2 * DOC_BLOCK + 1), generator=g)
    starts = torch.zeros(2, 2 * DOC_BLOCK + 1, dtype=torch.bool)
    for row, columns in enumerate(DOC_STARTS):
        starts[row, sorted(columns)] = True
    targets = tokens[:, 1:].masked_fill(starts[:, 1:], IGNORE_INDEX)
    return tokens[:, :-1], targets, starts[:, :-1]


def _documents_one_by_one(model, inputs, targets, resets):
    """The slow twin: every document of every row from its own fresh state, cut where the
    step cuts (chunk starts, state detached there: one chunk per backward); each piece's loss
    sum goes to its block. -> per block (mean loss, gradients)."""
    cuts = {b * DOC_BLOCK + c for b in range(2) for c in range(0, DOC_BLOCK, DOC_CHUNK)}
    sums = [0.0, 0.0]
    for row in range(inputs.shape[0]):
        doc_starts = [t for t in range(inputs.shape[1]) if resets[row, t]]
        for a, b in zip(doc_starts, [*doc_starts[1:], inputs.shape[1]], strict=True):
            state = model.init_state(1)
            edges = sorted({a, b, *(c for c in cuts if a < c < b)})
            for lo, hi in zip(edges[:-1], edges[1:], strict=True):
                hidden = model.forward_hidden(inputs[row : row + 1, lo:hi], state)
                loss = model.loss_from_hidden(hidden, targets[row : row + 1, lo:hi], "sum")
                sums[lo // DOC_BLOCK] = sums[lo // DOC_BLOCK] + loss
                state.detach_()
    params = [p for _, p in model.named_parameters()]
    out = []
    for block in range(2):
        columns = slice(block * DOC_BLOCK, (block + 1) * DOC_BLOCK)
        loss = sums[block] / (targets[:, columns] != IGNORE_INDEX).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        named = {n: g for (n, _), g in zip(model.named_parameters(), grads, strict=True)}
        out.append((loss.detach(), {n: g for n, g in named.items() if g is not None}))
    return out


@pytest.mark.parametrize(
    ("executor", "position"),
    [("dense", "rope"), ("chunked", "rope"), ("recurrent", "alibi")],
)
def test_streaming_document_resets_equal_each_document_from_a_fresh_state(executor, position):
    """Blocks whose rows start documents mid-chunk and on chunk boundaries, streamed with
    TBPTT: each block's loss and gradients equal those of running every document from its
    own fresh state at position 0 (fp64, 1e-10), so no token sees another document."""
    model = tiny_model(torch.float64, executor=executor, position=position, chunk_size=2, n_layer=1)
    inputs, targets, resets = _document_stream()
    expected = _documents_one_by_one(model, inputs, targets, resets)
    step = LanguageTrainModel(model, tbptt_chunk_size=DOC_CHUNK, streaming=True)
    for block, (loss, grads) in enumerate(expected):
        columns = slice(block * DOC_BLOCK, (block + 1) * DOC_BLOCK)
        out = step.train_step(
            SequenceBatch(inputs[:, columns], targets[:, columns], resets[:, columns])
        )
        assert_close(out.loss.double(), loss, rtol=1e-6, msg=f"block {block} loss (float)")
        assert_close(grads_of(model), grads, rtol=1e-10, msg=f"block {block} gradients")
    assert step.carried_state.position.tolist() == [6, 2]  # each row's last document
    first = SequenceBatch(inputs[:, :DOC_BLOCK], targets[:, :DOC_BLOCK], resets[:, :DOC_BLOCK])
    assert_close(step.valid_step(first).double(), expected[0][0], rtol=1e-6, msg="valid loss")


def test_row_resets_are_the_mask_with_only_its_first_column_set():
    """SequenceBatch.reset_mask is the one conversion of [B] flags; time_slice keeps [B] flags
    on the first chunk and slices a [B, T] mask; the step gives both forms the same result."""
    b = batch(b=2, t=5, seed=4)
    flags = SequenceBatch(b.inputs, b.targets, torch.tensor([False, True]))
    assert flags.reset_mask.tolist() == [[False] * 5, [True, False, False, False, False]]
    assert flags.time_slice(0, 2).reset.tolist() == [False, True]
    assert flags.time_slice(2, 5).reset is None
    mask = SequenceBatch(b.inputs, b.targets, flags.reset_mask)
    assert torch.equal(mask.time_slice(2, 5).reset, flags.reset_mask[:, 2:5])
    losses = []
    for form in (flags, mask):
        step = LanguageTrainModel(tiny_model(), tbptt_chunk_size=2, streaming=True)
        step.train_step(batch(b=2, t=5, seed=5))
        losses.append(step.train_step(form).loss)
        assert step.carried_state.position.tolist() == [10, 5]
    assert torch.equal(losses[0], losses[1])
    with pytest.raises(ValueError, match=r"reset must have shape \[B\]=\(2,\) or \[B, T\]"):
        SequenceBatch(b.inputs, b.targets, torch.zeros(2, 4, dtype=torch.bool))


def test_summary_memory_refuses_a_reset_inside_a_call():
    model = tiny_model(summary_memory=SummaryMemoryConfig(enabled=True, chunk_tokens=2))
    resets = torch.zeros(1, 4, dtype=torch.bool)
    resets[0, 2] = True
    with pytest.raises(ValueError, match="summary memory cannot reset a row in the middle"):
        model.forward_hidden(torch.zeros(1, 4, dtype=torch.long), reset_mask=resets)


def test_valid_step_does_not_touch_the_carried_state():
    step = LanguageTrainModel(tiny_model(), streaming=True)
    step.train_step(batch(t=4))
    before = step.carried_state.clone()
    step.valid_step(batch(t=4, seed=3))
    assert torch.equal(before.position, step.carried_state.position)
    assert all(torch.equal(a, b) for a, b in zip(before.rho, step.carried_state.rho, strict=True))


def test_carried_state_round_trips_through_state_dict():
    step = LanguageTrainModel(tiny_model(), streaming=True)
    step.train_step(batch(t=4))
    other = LanguageTrainModel(tiny_model(), streaming=True)
    other.load_state_dict(step.state_dict())
    assert torch.equal(other.carried_state.rho[1], step.carried_state.rho[1])
    assert other.gradient_scales.step == 1


# ------------------------------------------------------------------ pipeline emulation
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_pipeline_valid_loss_and_train_grads_equal_full_batch(schedule):
    model = tiny_model(n_layer=2)
    plan = build_pipeline_plan(
        2, stage_count=2, virtual_stages_per_rank=1, microbatches=2, schedule=schedule
    )
    b = batch(b=3, t=6)  # unequal microbatches: 2 + 1 rows
    full_loss, full_grads = full_gradients(model, b)
    step = LanguageTrainModel(model, pipeline_plan=plan)
    assert abs(step.valid_step(b) - full_loss) < 1e-5
    out = step.train_step(b)
    assert abs(out.loss - full_loss) < 1e-5
    for name, g in grads_of(model).items():
        assert_close(g, full_grads[name], rtol=1e-5, msg=name)


def test_pipeline_with_virtual_stages_matches_full_batch():
    model = tiny_model(n_layer=4)
    plan = build_pipeline_plan(
        4, 2, virtual_stages_per_rank=2, microbatches=4, schedule="interleaved_1f1b"
    )
    b = batch(b=4, t=5)
    full_loss, full_grads = full_gradients(model, b)
    out = LanguageTrainModel(model, pipeline_plan=plan).train_step(b)
    assert abs(out.loss - full_loss) < 1e-5
    assert_close(grads_of(model)["decoder"], full_grads["decoder"], rtol=1e-5)


def test_pipeline_plan_must_cover_the_model():
    """Pipeline + TBPTT or streaming is a config rule (tests/config/test_config.py); the step checks
    only that the plan it was given fits its model."""
    model = tiny_model(n_layer=2)
    with pytest.raises(ConfigError, match="pipeline plan covers 4 layers but model.n_layer is 2"):
        LanguageTrainModel(model, pipeline_plan=build_pipeline_plan(4, 2, 1, 2, "gpipe"))


def test_pipeline_batch_smaller_than_microbatches_is_an_error():
    plan = build_pipeline_plan(2, 2, 1, 2, "gpipe")
    with pytest.raises(ConfigError, match="parallel.microbatches"):
        LanguageTrainModel(tiny_model(n_layer=2), pipeline_plan=plan).train_step(batch(b=1))


# ------------------------------------------------------------------ gradient-scale schedules
def _norm(model, names):
    return sum(model.get_parameter(n).grad.pow(2).sum() for n in names).sqrt().item()


def test_backbone_scale_zero_freezes_backbone_but_not_surfaces():
    model = tiny_model(norm="layernorm_affine")
    transfer = {
        "backbone_grad_scale": 0.0,
        "backbone_grad_scale_steps": 1,
        "preserve_fresh_decoder": True,
        "preserve_fresh_norm": True,
    }
    step = LanguageTrainModel(
        model, gradient_scales=GradientScaleSchedule(model, init_transfer=transfer, total_steps=1)
    )
    backbone = groups.transferred_backbone_params(step.model, True, True)
    surface = groups.interface_surface_params(step.model, True, True)
    assert sorted(backbone) == ["encoder", "encoder_v"]
    assert sorted(surface) == ["decoder", "embed.weight", "lm_head", "norm.bias", "norm.weight"]
    b = SequenceBatch(SEED_INPUTS, SEED_TARGETS)
    LanguageTrainModel(model).train_step(b)
    assert _norm(model, backbone) > 0 and _norm(model, surface) > 0
    step.train_step(b)
    assert _norm(model, backbone) <= 1e-8
    assert _norm(model, surface) > 0
    step.train_step(b)  # past backbone_grad_scale_steps: the backbone trains again
    assert _norm(model, backbone) > 0


def test_half_scale_on_decoder_halves_its_gradient_norm():
    model = tiny_model()
    b = SequenceBatch(SEED_INPUTS, SEED_TARGETS)
    LanguageTrainModel(model).train_step(b)
    base = _norm(model, ["decoder"])
    other = _norm(model, ["encoder"])
    rules = [{"target": "shared_lowrank_decoder", "scale": 0.5}]
    step = LanguageTrainModel(model, gradient_scales=GradientScaleSchedule(model, rules))
    assert groups.params_for_target(step.model, "shared_lowrank_decoder") == ["decoder"]
    step.train_step(b)
    assert abs(_norm(model, ["decoder"]) / base - 0.5) < 1e-6
    assert abs(_norm(model, ["encoder"]) / other - 1.0) < 1e-6


def test_schedule_interpolates_from_half_to_one_over_two_steps():
    model = tiny_model()
    sched = {"final_scale": 1.0, "start_fraction": 0.0, "end_fraction": 1.0}
    rules = [
        {"target": t, "scale": 0.5, "schedule": sched}
        for t in ("shared_lowrank_encoder", "shared_lowrank_decoder")
    ]
    step = LanguageTrainModel(model, gradient_scales=GradientScaleSchedule(model, rules, None, 2))
    # four slots (decay, encoder, encoder_v, decoder); this model has no decay: 1.0 there
    assert abs(step.gradient_scales.shared_lowrank_target_lr_scale() - 0.625) < 1e-6
    b = SequenceBatch(SEED_INPUTS, SEED_TARGETS)
    LanguageTrainModel(model).train_step(b)
    base = _norm(model, ["decoder"])
    step.train_step(b)
    first = _norm(model, ["decoder"])
    step.train_step(b)
    second = _norm(model, ["decoder"])
    assert abs(first / base - 0.5) < 1e-6 and abs(second / base - 1.0) < 1e-6
    assert abs(step.gradient_scales.shared_lowrank_target_lr_scale() - 1.0) < 1e-6
    assert step.state_dict()["gradient_scales"] == {"step": 2}


def test_schedule_rule_midpoint_interpolation():
    from bdh_train.train.schedules import ScaleRule

    rule = ScaleRule.for_total_steps(
        0.0, {"final_scale": 1.0, "start_fraction": 0.25, "end_fraction": 0.75}, total_steps=9
    )
    assert (rule.start_step_index, rule.end_step_index) == (2, 6)
    assert [rule.scale_at(i) for i in range(8)] == [0, 0, 0, 0.25, 0.5, 0.75, 1.0, 1.0]


# ------------------------------------------------------------------ profiling
def _profiled(settings, **step_kwargs):
    profiler = StepProfiler(settings=settings)
    return LanguageTrainModel(profiler=profiler, **step_kwargs), profiler


class OpClock(TorchDispatchMode):
    """A clock that advances by one per tensor operation dispatched (forward and backward):
    a stand-in for time that a loaded machine cannot disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def now(self) -> float:
        return float(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_detail_probe_times_are_ordered():
    """What each probe times, through a clock that counts operations (wall time on a shared
    2-core machine varies 50x between identical passes): a backward costs at least half its
    forward, so a forward alone is below 2/3 of the same forward with its backward; one layer
    costs less than half of three, the embedding less than a layer,
    the loss from logits less than the loss from hidden states (which adds the logits); the
    step's forward is the model's forward plus the loss."""
    model = tiny_model(n_layer=3)
    step, profiler = _profiled(ProfileSettings("detail"), model=model)
    clock = OpClock()
    with clock, mock.patch.object(profile_module.time, "perf_counter", clock.now):
        out = step.train_step(batch(b=2, t=12))
    row = profile_row([out.stats["profile"]])
    assert set(row) == {"forward_s", "backward_s", *(f"probe_{n}_s" for n in PROBES)}
    probe = {name: row[f"probe_{name}_s"] for name in PROBES}
    assert 1.5 * probe["first_layer_forward"] < probe["first_layer_forward_backward"]
    assert 1.5 * probe["model_forward"] < probe["model_forward_backward"]
    assert 2 * probe["first_layer_forward"] < probe["model_forward"]
    assert probe["embed"] < probe["first_layer_forward"]
    assert probe["logits_loss"] < probe["hidden_logits_loss"]
    assert probe["model_forward"] < row["forward_s"] < probe["model_forward_backward"]
    assert row["backward_s"] > 0
    assert "whole model forward+backward" in profiler.summary()


def test_a_known_allocation_moves_the_memory_reading():
    """64 MiB allocated (and touched) during the forward and held past the backward: the
    readings after forward and after backward are at least that far above the one before."""
    step, _ = _profiled(ProfileSettings("step", memory=True), model=tiny_model())
    held: list[torch.Tensor] = []
    piece_loss = step._piece_loss

    def allocating(*args):
        if step.profiler.recorded == 0 and not held:  # the first step only
            held.append(torch.ones(16 * 2**20))  # 64 MiB of float32, every page written
        return piece_loss(*args)

    step._piece_loss = allocating
    p = step.train_step(batch()).stats["profile"]
    mib = 2**20
    assert p.memory_after_forward.in_use - p.memory_before.in_use >= 60 * mib
    assert p.memory_after_backward.in_use - p.memory_before.in_use >= 60 * mib
    assert p.memory_before.reserved is None  # reserved bytes are a CUDA reading
    held.clear()
    again = step.train_step(batch()).stats["profile"]  # released: the reading falls back
    assert again.memory_after_forward.in_use < p.memory_after_forward.in_use - 50 * mib


def test_detail_probes_leave_training_bit_identical():
    """Streaming TBPTT with dropout, 3 steps, with and without detail probes (and memory
    readings): gradients, carried state and the random generator state are bit-identical.
    The probes run dropout and backward passes of their own, so this fails if they consume
    the training's random numbers, write into .grad or touch the carried state."""
    results = []
    for settings in (None, ProfileSettings("detail", memory=True)):
        model = tiny_model(dropout=0.2)
        kwargs = dict(model=model, tbptt_chunk_size=3, tbptt_backprop_chunks=2, streaming=True)
        if settings is None:
            step = LanguageTrainModel(**kwargs)
        else:
            step = _profiled(settings, **kwargs)[0]
        torch.manual_seed(7)
        trace = []
        for i in range(3):
            b = batch(t=10, seed=i)
            b.reset = torch.tensor([i == 0, i != 1])
            out = step.train_step(b)
            state = step.carried_state
            trace.append((out.loss, grads_of(model), state.position.clone(), list(state.rho)))
        results.append((trace, torch.get_rng_state()))
    (plain, plain_rng), (probed, probed_rng) = results
    assert torch.equal(plain_rng, probed_rng)
    for (loss, grads, pos, rho), (loss2, grads2, pos2, rho2) in zip(plain, probed, strict=True):
        assert torch.equal(loss, loss2) and torch.equal(pos, pos2)
        assert grads.keys() == grads2.keys()
        assert all(torch.equal(grads[n], grads2[n]) for n in grads)
        assert all(torch.equal(a, b) for a, b in zip(rho, rho2, strict=True))


def test_nca_head_has_no_logits_probe():
    model = tiny_model(vocab_size=20, language_head=NCA_HEAD)
    step, _ = _profiled(ProfileSettings("detail"), model=model)
    b = SequenceBatch(torch.randint(0, 19, (2, 6)), torch.randint(0, 19, (2, 6)))
    probes = step.train_step(b).stats["profile"].probes_s
    assert set(probes) == set(PROBES) - {"logits_loss"}


def test_window_row_sums_times_and_keeps_first_highest_last_memory():
    """One optimizer step's row from its micro-steps: times add up; memory is the reading
    before the first micro-step, the highest after a forward, and after the last backward."""
    mib = 2**20
    a = StepProfile(
        1.0,
        2.0,
        MemoryReading(1 * mib, 8 * mib),
        MemoryReading(5 * mib, 9 * mib),
        MemoryReading(2 * mib, 9 * mib),
        {"embed": 0.5},
    )
    b = StepProfile(
        0.5,
        1.0,
        MemoryReading(3 * mib, 9 * mib),
        MemoryReading(4 * mib, 12 * mib),
        MemoryReading(3 * mib, 12 * mib),
        {"embed": 0.25},
    )
    assert profile_row([a, b]) == {
        "forward_s": 1.5,
        "backward_s": 3.0,
        "probe_embed_s": 0.75,
        "mem_before_mib": 1.0,
        "mem_before_reserved_mib": 8.0,
        "mem_after_forward_mib": 5.0,
        "mem_after_forward_reserved_mib": 12.0,
        "mem_after_backward_mib": 3.0,
        "mem_after_backward_reserved_mib": 12.0,
    }


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        (("off", False), {}, ProfileSettings("off", False)),
        (("off", False), {"BDH_PROFILE": "1"}, ProfileSettings("step", False)),
        (("off", False), {"BDH_PROFILE": "detail"}, ProfileSettings("detail", False)),
        (("step", False), {"BDH_PROFILE_DETAIL": "true"}, ProfileSettings("detail", False)),
        (("detail", True), {"BDH_PROFILE_DETAIL": "0"}, ProfileSettings("step", True)),
        (
            ("detail", True),
            {"BDH_PROFILE": "off", "BDH_PROFILE_MEMORY": "no"},
            ProfileSettings("off", False),
        ),
        (("off", False), {"BDH_PROFILE_MEMORY": "on"}, ProfileSettings("step", True)),
        (("off", True), {}, ProfileSettings("step", True)),
    ],
)
def test_environment_overrides_the_profile_settings(config, env, expected):
    settings = ProfileSettings.resolve(*config, environ=env)
    assert settings == expected
    assert settings.enabled == (expected.mode != "off")


def test_unreadable_profile_environment_is_named():
    with pytest.raises(ConfigError, match="BDH_PROFILE_MEMORY must be 1/true/yes/on or 0/false"):
        ProfileSettings.resolve("off", False, environ={"BDH_PROFILE_MEMORY": "maybe"})
    with pytest.raises(ConfigError, match="BDH_PROFILE must be .* or one of"):
        ProfileSettings.resolve("off", False, environ={"BDH_PROFILE": "details"})


def test_profiling_disabled_reads_no_clock_and_syncs_nothing():
    step = LanguageTrainModel(tiny_model(), tbptt_chunk_size=3)
    assert not step.profiler.detail
    with (
        mock.patch.object(profile_module.time, "perf_counter") as clock,
        mock.patch.object(torch.cuda, "synchronize") as sync,
    ):
        out = step.train_step(batch())
    clock.assert_not_called()
    sync.assert_not_called()
    assert "profile" not in out.stats


def test_valid_step_runs_without_dropout_and_restores_train_mode():
    noisy = tiny_model(dropout=0.5)
    clean = tiny_model(dropout=0.0, seed=1)
    clean.load_state_dict(noisy.state_dict())
    b = batch(b=2, t=12, seed=4)
    reference = LanguageTrainModel(clean, tbptt_chunk_size=5).valid_step(b)
    step = LanguageTrainModel(noisy, tbptt_chunk_size=5)
    noisy.train()
    first = step.valid_step(b)
    second = step.valid_step(b)
    assert noisy.training, "valid_step must give the model back in train mode"
    assert torch.equal(first, second), f"two valid steps differ: {first} vs {second}"
    assert torch.equal(first, reference), f"valid loss {first} != dropout-free {reference}"
    with torch.no_grad():  # the same loss through the model in train mode does see dropout
        noisy_loss = noisy.loss_from_hidden(noisy.forward_hidden(b.inputs), b.targets)
    assert abs(float(noisy_loss) - float(reference)) > 1e-4


# ------------------------------------------------------------------ exact small rules
def test_columns_slices_time_steps_and_passes_none_through():
    mask = torch.arange(12).view(2, 6)
    assert torch.equal(_columns(mask, 1, 4), mask[:, 1:4])
    assert _columns(None, 1, 4) is None


def test_pipeline_microbatches_apply_document_resets():
    """A [B, T] reset restarts a row mid-block in the pipeline as in the plain step."""
    model = tiny_model(n_layer=2)
    plan = build_pipeline_plan(2, 2, 1, 2, "gpipe")
    b = batch(b=2, t=6)
    plain = LanguageTrainModel(model).valid_step(b)
    b.reset = torch.zeros(2, 6, dtype=torch.bool)
    b.reset[1, 3] = True
    reset = LanguageTrainModel(model).valid_step(b)
    assert abs(reset - plain) > 1e-4  # the reset changes the loss
    assert abs(LanguageTrainModel(model, pipeline_plan=plan).valid_step(b) - reset) < 1e-6


def test_pipeline_microbatches_apply_summary_events():
    memory = SummaryMemoryConfig(enabled=True, chunk_tokens=2, write_gate=True)
    model = tiny_model(n_layer=2, summary_memory=memory)
    plan = build_pipeline_plan(2, 2, 1, 2, "gpipe")
    b = batch(b=2, t=6)
    plain = LanguageTrainModel(model).valid_step(b)
    b.summary_event_mask = torch.tensor([[0, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0]])
    events = LanguageTrainModel(model).valid_step(b)
    assert abs(events - plain) > 1e-4
    assert abs(LanguageTrainModel(model, pipeline_plan=plan).valid_step(b) - events) < 1e-6


def test_detail_probes_cover_one_backward_window_with_its_summary_events():
    """With TBPTT the probes run on the first chunk * backprop_chunks tokens (the most the
    step holds) and those tokens' summary events."""
    model = tiny_model(summary_memory=SummaryMemoryConfig(enabled=True, chunk_tokens=2))
    step, _ = _profiled(
        ProfileSettings("detail"), model=model, tbptt_chunk_size=2, tbptt_backprop_chunks=2
    )
    b = batch(t=12)
    b.summary_event_mask = (torch.arange(12) % 3 == 1).long().expand(2, 12).clone()
    probed, asked = [], []
    forward, grad = model.forward_hidden, torch.autograd.grad

    def recording(inputs, *args, **kwargs):
        if "reset_mask" not in kwargs:  # the step's own pieces pass their reset mask
            u = kwargs.get("u")
            embedded = None if u is None else (tuple(u.shape), u.requires_grad)
            probed.append((inputs.shape[1], kwargs["summary_event_mask"], kwargs.get("layers")))
            probed[-1] += (embedded,)
        return forward(inputs, *args, **kwargs)

    def asking(outputs, inputs, **kwargs):
        asked.append(len(inputs))
        return grad(outputs, inputs, **kwargs)

    with (
        mock.patch.object(model, "forward_hidden", recording),
        mock.patch.object(torch.autograd, "grad", asking),
    ):
        step.train_step(b)
    d = model.config.n_embd
    first = [(range(1), ((2, 4, d), False)), (range(1), ((2, 4, d), True))]
    assert [p[2:] for p in probed] == [*first, (None, None), (None, None)]
    for width, events, *_ in probed:  # first layer (twice), the model forward, its backward
        assert width == 4 and torch.equal(events, b.summary_event_mask[:, :4])
    params = sum(p.requires_grad for p in model.parameters())
    # embed, first layer (+ its input), logits (the logits alone), head (+ hidden), model
    assert asked == [params, params + 1, 1, params + 1, params]


def test_load_state_dict_names_a_missing_schedule_and_clears_the_carried_state():
    step = LanguageTrainModel(tiny_model(), streaming=True)
    step.train_step(batch(t=4))
    with pytest.raises(CheckpointError) as err:
        step.load_state_dict({})
    assert str(err.value) == "train-step state has no valid 'gradient_scales': 'gradient_scales'"
    assert step.carried_state is not None  # refused before anything changed
    step.load_state_dict({"gradient_scales": {"step": 0}, "carried_state": None})
    assert step.carried_state is None
    step.train_step(batch(t=4))
    step.load_state_dict({"gradient_scales": {"step": 0}})
    assert step.carried_state is None


def test_a_state_is_made_only_when_read_and_a_carried_one_read_only_when_streaming():
    model = tiny_model()
    streamed = LanguageTrainModel(model, streaming=True)
    streamed.train_step(batch(t=4))
    b = batch(t=4, seed=1)
    fresh = LanguageTrainModel(model, tbptt_chunk_size=2).train_step(b).loss
    chunked = LanguageTrainModel(model, tbptt_chunk_size=2)
    chunked.load_state_dict(streamed.state_dict())  # a carried state it must not read
    assert torch.equal(chunked.train_step(b).loss, fresh)
    states = []
    forward = model.forward_hidden

    def recording(inputs, state, **kwargs):
        states.append(state)
        return forward(inputs, state, **kwargs)

    with mock.patch.object(model, "forward_hidden", recording):
        LanguageTrainModel(model).train_step(b)  # one chunk, not streaming: no final state
        LanguageTrainModel(model, tbptt_chunk_size=4).train_step(b)  # a chunk of the block
    assert states == [None, None]


def test_step_defaults_and_the_chunk_rule():
    model = tiny_model()
    step = LanguageTrainModel(model)
    assert (step.tbptt_chunk_size, step.tbptt_backprop_chunks, step.streaming) == (0, 1, False)
    assert step.pipeline_plan is None and step.carried_state is None
    assert isinstance(step.profiler, NullProfiler) and step.autocast is contextlib.nullcontext
    assert step.gradient_scales.state_dict() == {"step": 0}
    assert step.effective_chunk_size(3) is None
    chunked = LanguageTrainModel(model, tbptt_chunk_size=5)
    assert [chunked.effective_chunk_size(t) for t in (4, 5, 6)] == [None, None, 5]
    assert LanguageTrainModel(model, tbptt_chunk_size=1).effective_chunk_size(2) == 1
    with pytest.raises(ConfigError) as err:
        LanguageTrainModel(tiny_model(n_layer=2), pipeline_plan=build_pipeline_plan(4, 2, 1, 2))
    assert str(err.value) == "the pipeline plan covers 4 layers but model.n_layer is 2"


def test_the_loss_is_the_sum_over_the_counted_targets_or_the_normalizer_given():
    """One counted target: the mean is the sum (not halved); a given normalizer divides the
    sum; the loss scale multiplies the gradients; no counted target gives 0."""
    model = tiny_model()
    b = batch(t=4)
    b.targets[:] = IGNORE_INDEX
    b.targets[1, 2] = 5
    with torch.no_grad():
        total = model.loss_from_hidden(model.forward_hidden(b.inputs), b.targets, reduction="sum")
    step = LanguageTrainModel(model)
    out = step.train_step(b)
    assert out.counted == 1.0 and out.loss.dtype == torch.float32 and out.stats == {}
    assert abs(out.loss - total) < 1e-6
    once = grads_of(model)
    model.zero_grad(set_to_none=True)
    out = step.compute_gradients(b, loss_scale=3.0, normalizer=4.0)
    assert abs(out.loss - total / 4) < 1e-6 and out.counted == 1.0
    for name, g in grads_of(model).items():
        assert_close(g, once[name] * 0.75, rtol=1e-6, msg=name)
    b.targets[1, 2] = IGNORE_INDEX
    out = step.train_step(b)
    assert out.counted == 0.0 and out.loss == 0.0


def test_chunk_losses_add_up_in_float64():
    """Pieces 1, 2**-24, 2**-24: in float64 the sum is 1 + 2**-23 (a float32 value); added up
    in float32 each 2**-24 rounds away and the loss would read 1."""
    step = LanguageTrainModel(tiny_model(), tbptt_chunk_size=1)
    piece_loss = step._piece_loss
    values: list[float] = []

    def chosen(*args):
        return piece_loss(*args) * 0 + values.pop(0)

    step._piece_loss = chosen
    values[:] = [1.0, 2.0**-24, 2.0**-24]
    assert step.train_step(batch(t=3)).loss.item() == 1.0 + 2.0**-23
    values[:] = [1.0, 2.0**-24, 2.0**-24]
    assert step.valid_step(batch(t=3)).item() == 1.0 + 2.0**-23


def test_train_step_drops_stale_gradients_instead_of_zeroing_them():
    model = tiny_model()
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(1)))
    model.unused.grad = torch.ones(1)  # left by an earlier step; nothing this step reaches
    LanguageTrainModel(model).train_step(batch(t=4))
    assert model.unused.grad is None
