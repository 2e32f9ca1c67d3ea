"""Chunked == dense == recurrent (issue 2): hidden, loss, final state and gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.model.mixer import EXECUTORS, choose_executor, linear_attention


def run(model, idx, targets, executor, chunk_size, warm_state):
    model.config.executor = executor
    model.config.chunk_size = chunk_size
    model.zero_grad()
    state = model.init_state(idx.shape[0])
    if warm_state:  # a non-zero incoming state, built without gradients
        with torch.no_grad():
            model.forward_hidden(idx.flip(1), state, executor="dense")
    hidden = model.forward_hidden(idx, state)
    loss = model.loss_from_hidden(hidden, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return hidden.detach(), loss.detach(), [r.detach() for r in state.rho], grads


@pytest.mark.parametrize("position", ["rope", "alibi"])
@pytest.mark.parametrize("warm_state", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11])
def test_executors_agree_fp32(position, warm_state, chunk_size):
    torch.manual_seed(1)
    model = tiny_model(position=position, norm="layernorm_affine")
    seq_len = 11  # chunk sizes 1, 3 (does not divide), 4 (does not divide), 11 (= T)
    idx = torch.randint(0, 32, (2, seq_len))
    targets = torch.randint(0, 32, (2, seq_len))
    ref = run(model, idx, targets, "dense", chunk_size, warm_state)
    for executor in (e for e in EXECUTORS if e != "dense"):
        got = run(model, idx, targets, executor, chunk_size, warm_state)
        assert_close(got[0], ref[0], rtol=1e-5, msg=f"{executor} hidden")
        assert abs(got[1] - ref[1]) / ref[1] < 1e-5, f"{executor} loss differs"
        for r_got, r_ref in zip(got[2], ref[2], strict=True):
            assert_close(r_got, r_ref, rtol=1e-5, msg=f"{executor} final rho")
        for name, g in got[3].items():
            assert_close(g, ref[3][name], rtol=1e-4, msg=f"{executor} grad of {name}")


def test_chunk_size_dividing_t_exactly():
    model = tiny_model(position="rope")
    idx = torch.randint(0, 32, (3, 16))
    targets = torch.randint(0, 32, (3, 16))
    ref = run(model, idx, targets, "dense", 4, True)
    got = run(model, idx, targets, "chunked", 4, True)
    assert_close(got[0], ref[0], rtol=1e-5)
    for name, g in got[3].items():
        assert_close(g, ref[3][name], rtol=1e-4, msg=name)


def test_auto_cost_model_picks_dense_short_chunked_long():
    assert choose_executor(64, 512, 128, 64) == "dense"
    assert choose_executor(256, 512, 128, 64) == "dense"
    assert choose_executor(2048, 512, 128, 64) == "chunked"
    assert choose_executor(4096, 2048, 256, 256) == "chunked"
    assert choose_executor(512, 2048, 256, 256) == "dense"


def test_unknown_executor_is_rejected():
    q = torch.zeros(1, 1, 2, 4)
    v = torch.zeros(1, 1, 2, 3)
    with pytest.raises(ValueError, match="unknown executor 'fast'"):
        linear_attention(q, v, executor="fast", chunk_size=4)
