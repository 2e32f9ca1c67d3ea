"""benchmarks/bench_official.py's built-in baseline (the official model's forward, written
out) against bdh-train's model on the same weights, and its FLOP count against torch's."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from helpers import IN_PLACE_PRODUCTS, assert_close
from torch.utils.flop_counter import FlopCounterMode

from bdh_train.model import chunked_grad, mixer
from bdh_train.model.chunked_grad import sums_by_product
from bdh_train.model.positions import rope_frequencies
from bdh_train.train.step import LanguageTrainModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_official  # noqa: E402

SHAPE = dict(n_layer=2, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4)
CPU = torch.device("cpu")


def _pair(executor: str, chunk_size: int = 8):
    torch.manual_seed(0)
    baseline = bench_official.build_baseline(SHAPE, None)
    ours = bench_official.ours_from_baseline(baseline, executor)
    ours.config.chunk_size = chunk_size
    return baseline, ours


@pytest.mark.parametrize("executor", ["dense", "chunked"])
def test_baseline_train_step_equals_bdh_train_fp64(executor):
    """The loss, and every parameter gradient of bdh-train's train step, agree to 1e-10 in
    float64."""
    baseline, ours = _pair(executor)
    baseline.double()
    ours.double()
    # the official buffer holds float32-rounded frequencies; float64 ones isolate the formulas
    baseline.attn.freqs = rope_frequencies(baseline.n_neurons).view(1, 1, 1, -1)
    batch = bench_official.random_batch(20, 2, CPU)
    _, loss = baseline(batch.inputs, batch.targets)
    loss.backward()
    assert_close(ours(batch.inputs, batch.targets)[1], loss, rtol=1e-10)
    LanguageTrainModel(ours).train_step(batch)
    theirs = dict(baseline.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, theirs[name].grad, rtol=1e-10)


def test_baseline_fp32_logits_close_to_bdh_train():
    """fp32 (float32 rope phases in the baseline, float64 in bdh-train) at T=64: 1e-5."""
    baseline, ours = _pair("auto", chunk_size=256)
    assert bench_official.max_logit_difference(baseline, ours, CPU) < 1e-5


def test_train_flops_formula_counts_what_runs(monkeypatch):
    """train_flops_per_token equals torch's count of one train step's matmuls (forward and
    backward) for the baseline's masked dense form and bdh-train's dense (whole, and in row
    panels of 8: a short last panel) and chunked executors (chunk 8 over T=30: a short last
    chunk), whose backward takes the symmetric scores' gradient as one product. On the CPU the
    chunk states are running sums (no product); as the [K, K] product (a GPU's) they are
    counted too."""
    seq_len = 30
    batch = bench_official.random_batch(seq_len, 2, CPU)
    tokens = batch.inputs.numel()
    baseline, _ = _pair("dense")
    with FlopCounterMode(display=False) as counter:
        baseline(batch.inputs, batch.targets)[1].backward()
    dense = tokens * bench_official.train_flops_per_token(SHAPE, seq_len, None)
    assert counter.get_total_flops() == pytest.approx(dense, rel=1e-12)
    cpu = mixer.calibration_for("cpu")
    for executor, chunk, panel_rows in (("dense", None, 0), ("dense", None, 8), ("chunked", 8, 0)):
        calibration = dataclasses.replace(cpu, dense_panel_rows=panel_rows)
        monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", calibration)
        _, ours = _pair(executor)
        assert bench_official.ours_executor(ours, seq_len) == (chunk, panel_rows)
        with FlopCounterMode(display=False, custom_mapping=IN_PLACE_PRODUCTS) as counter:
            LanguageTrainModel(ours).train_step(batch)
        # fp32 without decay: the scores' gradient is one product (the hand-written backward)
        expected = tokens * bench_official.train_flops_per_token(
            SHAPE, seq_len, chunk, True, panel_rows, sums_by_product("cpu")
        )
        assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12), panel_rows
    # the chunk states as the [K, K] product, as a GPU computes them
    monkeypatch.setattr(chunked_grad, "sums_by_product", lambda device_type: True)
    with FlopCounterMode(display=False, custom_mapping=IN_PLACE_PRODUCTS) as counter:
        LanguageTrainModel(ours).train_step(batch)
    expected = tokens * bench_official.train_flops_per_token(SHAPE, seq_len, 8, True, 0, True)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12), "states by product"
