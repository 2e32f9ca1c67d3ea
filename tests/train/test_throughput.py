"""Throughput: a training step's FLOPs per token counted from the executor that runs, against
hand counts of tiny models; the MFU arithmetic; the peak measurement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model

from bdh_train.data.eval_windows import eval_batches
from bdh_train.train import throughput
from bdh_train.train.step import LanguageTrainModel
from bdh_train.train.throughput import Throughput, measure_peak_flops, train_flops_per_token

# tiny_model: 2 layers, D = 16, 2 heads of N = 4 * 16 / 2 = 32 neurons, vocab 32, chunks of 4
L, D, H, N, V, T = 2, 16, 2, 32, 32, 8


def _count(executor: str) -> float | None:
    batch = next(eval_batches(np.arange(T + 1) % V, T, 1, 1))
    return train_flops_per_token(LanguageTrainModel(tiny_model(executor=executor)), batch)


def test_the_flops_of_a_dense_step_by_hand():
    """Forward multiply-adds per token: per layer the encoder, value encoder and decoder
    (3 H D N) and the T x T scores and their product with the values (H T (N + D)); the head
    (D V). A step is 2 FLOPs per multiply-add, 3 passes' worth (backward = 2 forwards), less
    one scores' gradient product (H T N per layer), which the hand-written backward takes as
    one symmetric product: 2 * (3 * 8,192 - 1,024) = 47,104."""
    forward = L * (3 * H * D * N + H * T * (N + D)) + D * V
    assert forward == 8192
    assert _count("dense") == 2 * (3 * forward - L * H * T * N) == 47104


def test_the_flops_of_a_chunked_step_by_hand():
    """Chunks of C = 4: the scores are two C x C blocks (C (N + D) per token and head), and
    every chunk reads its state and writes its part (2 N D per token and head); on the CPU
    the chunk states are running sums (not counted): 2 * (3 * 11,520 - 512) = 68,096."""
    c = 4
    forward = L * (3 * H * D * N + H * c * (N + D) + H * 2 * N * D) + D * V
    assert forward == 11520
    assert _count("chunked") == 2 * (3 * forward - L * H * c * N) == 68096


def test_counting_leaves_the_run_as_it_was():
    """The random generator (dropout's) and the gradients are as before the count."""
    model = tiny_model(dropout=0.1)
    batch = next(eval_batches(np.arange(T + 1) % V, T, 1, 1))
    before = torch.get_rng_state()
    assert train_flops_per_token(LanguageTrainModel(model), batch) is not None
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
    assert train_flops_per_token(object(), batch) is None  # not a counted executor


def test_mfu_is_the_rate_times_the_flops_over_the_peak():
    t = Throughput(flops_per_token=2e6, peak_flops=4e11, peak_source="given")
    assert t.mfu(50_000) == 50_000 * 2e6 / 4e11 == 0.25
    assert (
        t.describe() == "2 MFLOP per token (a training step's, counted); peak 400 GFLOP/s (given)"
    )


def test_the_peak_is_measured_by_a_product(monkeypatch):
    """The real measurement (helpers.constant_peak replaces it for the other tests), on a 64-square
    product: a positive rate."""
    monkeypatch.undo()  # the autouse constant peak
    monkeypatch.setitem(throughput.PEAK_MATMUL_SIZE, "cpu", 64)
    assert throughput.measure_peak_flops(torch.device("cpu")) > 0


@pytest.mark.parametrize("peak", [0.0, 5e10])
def test_a_runs_peak_is_given_or_measured_and_counts_every_device(peak):
    from bdh_train.config import load_config
    from bdh_train.data.tokens import TokenData

    cfg = load_config(
        overrides=["training.block_size=8", f"training.peak_flops={peak}"], preset="tiny"
    )
    step = LanguageTrainModel(tiny_model(executor="dense"))
    data = TokenData(np.arange(40) % V, V, "ids")
    got = throughput.run_throughput(step, data, cfg.training, cfg.data, torch.device("cpu"), 2)
    assert got is not None and got.flops_per_token == 47104
    assert got.peak_flops == 2 * (peak or 1e11)  # the tests' measured peak: helpers.constant_peak
    assert got.peak_source.endswith(", x 2 devices")


def test_measuring_the_peak_draws_nothing_from_the_run_s_random_stream():
    from unittest import mock

    """The peak's matrices come from a generator of its own: a run that measures its peak
    trains on the same random windows as one given training.peak_flops."""
    from bdh_train.train.throughput import PEAK_MATMUL_SIZE

    before = torch.random.get_rng_state()
    with mock.patch.dict(PEAK_MATMUL_SIZE, {"cpu": 64}):  # the function, not suite_setup's constant
        assert measure_peak_flops(torch.device("cpu")) > 0
    assert torch.equal(torch.random.get_rng_state(), before)
