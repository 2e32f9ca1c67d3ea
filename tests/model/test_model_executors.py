"""Chunked == dense == recurrent: hidden, loss, final state and gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.model.mixer import (
    EXECUTORS,
    choose_executor,
    chunked_attention,
    dense_attention,
    linear_attention,
)
from bdh_train.model.positions import alibi_log_decay


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


@pytest.mark.parametrize(
    "position", ["rope", "alibi", "alibi_learned", "alibi_spread", "alibi_slow"]
)
@pytest.mark.parametrize("warm_state", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11])
def test_executors_agree_fp32(position, warm_state, chunk_size):
    torch.manual_seed(1)
    model = tiny_model(position=position, norm="layernorm_affine")
    if position == "alibi_learned":  # rates away from alibi's; its gradient is compared too
        with torch.no_grad():
            model.decay_log_gain.copy_(torch.tensor([0.7, -0.9]))
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


def definition_attention(q, v, log_decay):
    """out_t = sum_{s<t} d^(t-s) (q_t . q_s) v_s and rho_T = sum_s d^(T-s) q_s^T v_s, as
    plain loops over t and s in float64 (rho0 = 0), all heads at once."""
    batch, heads, seq_len, n = q.shape
    decay = torch.ones(heads, dtype=torch.float64)
    if log_decay is not None:
        decay = torch.exp(log_decay.double())
    decay = decay.view(1, heads, 1)
    qd, vd = q.detach().double(), v.detach().double()[:, 0]  # [B, H, T, N], [B, T, D]
    out = torch.zeros(batch, heads, seq_len, v.shape[-1], dtype=torch.float64)
    for t in range(seq_len):
        for s in range(t):
            score = (qd[:, :, t] * qd[:, :, s]).sum(-1, keepdim=True)  # [B, H, 1]
            out[:, :, t] += decay ** (t - s) * score * vd[:, None, s]
    rho = torch.zeros(batch, heads, n, v.shape[-1], dtype=torch.float64)
    for s in range(seq_len):
        write = qd[:, :, s, :, None] * vd[:, None, s, None, :]  # [B, H, N, D]
        rho += decay.view(1, heads, 1, 1) ** (seq_len - s) * write
    return out, rho


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "alibi"])
@pytest.mark.parametrize("need_state", [False, True], ids=["output-only", "with-state"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_chunked_without_incoming_state_equals_dense_at_op_level(decay, need_state, dtype, tol):
    """chunked_attention(q, v, rho=None) -- the ordinary training path when T exceeds the
    chunk -- against dense_attention: output, final state and the gradients of q and v under
    random upstream gradients; dense against the definition in float64."""
    g = torch.Generator().manual_seed(7)
    batch, heads, seq_len, n, d = 2, 3, 13, 8, 5
    q0 = torch.randn(batch, heads, seq_len, n, generator=g, dtype=torch.float64) / n**0.5
    v0 = torch.randn(batch, 1, seq_len, d, generator=g, dtype=torch.float64)
    grad_out = torch.randn(batch, heads, seq_len, d, generator=g, dtype=torch.float64)
    grad_rho = torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
    log_decay = alibi_log_decay(heads) if decay else None

    def run(executor, **chunking):
        q = q0.to(dtype).requires_grad_()
        v = v0.to(dtype).requires_grad_()
        out, rho = executor(
            q,
            v,
            initial_state=None,
            log_decay=log_decay,
            output_final_state=need_state,
            **chunking,
        )
        objective = (out * grad_out.to(dtype)).sum()
        if need_state:
            objective = objective + (rho * grad_rho.to(dtype)).sum()
        else:
            assert rho is None
        objective.backward()
        return out.detach(), None if rho is None else rho.detach(), q.grad, v.grad

    ref = run(dense_attention)
    if dtype == torch.float64:
        want_out, want_rho = definition_attention(q0, v0, log_decay)
        assert_close(ref[0], want_out, rtol=1e-12, msg="dense output differs from the definition")
        if need_state:
            assert_close(ref[1], want_rho, rtol=1e-12, msg="dense state differs from definition")
    for chunk_size in (1, 4, 5, 12, 13, 20):  # 4, 5, 12 leave a ragged last chunk
        got = run(chunked_attention, chunk_size=chunk_size)
        where = f"chunk_size={chunk_size}, {dtype}, tolerance {tol:g}"
        assert_close(got[0], ref[0], rtol=tol, msg=f"chunked output differs from dense ({where})")
        if need_state:
            assert_close(got[1], ref[1], rtol=tol, msg=f"chunked final state differs ({where})")
        assert_close(got[2], ref[2], rtol=tol, msg=f"gradient of q differs ({where})")
        assert_close(got[3], ref[3], rtol=tol, msg=f"gradient of v differs ({where})")


@pytest.mark.parametrize("position", ["rope", "alibi"])
@pytest.mark.parametrize(
    ("executor", "chunk_size"), [("dense", 4), ("chunked", 8), ("chunked", 12)]
)
def test_the_heads_major_layout_computes_the_contiguous_one(
    monkeypatch, position, executor, chunk_size
):
    """Long calls (T=40 > 32 for D=16, N=32) keep the neurons heads-major from the projection
    through rope, the mixer, the norm and the gate; the same model with every projection
    forced into the contiguous layout gives the same hidden states, loss, final state and
    gradients (float64, 1e-12), from a carried state."""
    import bdh_train.model.matmul as matmul

    model = tiny_model(torch.float64, position=position)
    idx = torch.randint(0, 32, (3, 40))
    targets = torch.randint(0, 32, (3, 40))
    assert matmul.heads_major(torch.empty(3, 1, 40, 16), model.encoder)
    fast = run(model, idx, targets, executor, chunk_size, warm_state=True)
    monkeypatch.setattr(matmul, "heads_major", lambda inputs, weight: False)
    slow = run(model, idx, targets, executor, chunk_size, warm_state=True)
    assert_close(fast[0], slow[0], rtol=1e-12, msg="hidden")
    assert abs(fast[1] - slow[1]) <= 1e-12 * abs(slow[1])
    for r_fast, r_slow in zip(fast[2], slow[2], strict=True):
        assert r_fast.is_contiguous()
        assert_close(r_fast, r_slow, rtol=1e-12, msg="final rho")
    for name, g in fast[3].items():
        assert_close(g, slow[3][name], rtol=1e-12, msg=f"grad of {name}")
