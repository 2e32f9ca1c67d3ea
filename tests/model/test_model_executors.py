"""Chunked == dense == recurrent (issue 2): hidden, loss, final state and gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from bdh_train.model.mixer import choose_executor, chunked_attention, dense_attention
from bdh_train.model.positions import alibi_log_decay

EXECUTORS = ("dense", "chunked", "recurrent")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


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
    for executor in ("chunked", "recurrent"):
        got = run(model, idx, targets, executor, chunk_size, warm_state)
        assert rel_err(got[0], ref[0]) < 1e-5, f"{executor} hidden differs (fp32 tol 1e-5)"
        assert abs(got[1] - ref[1]) / ref[1] < 1e-5, f"{executor} loss differs"
        for r_got, r_ref in zip(got[2], ref[2], strict=True):
            assert rel_err(r_got, r_ref) < 1e-5, f"{executor} final rho differs"
        for name, g in got[3].items():
            assert rel_err(g, ref[3][name]) < 1e-4, f"{executor} grad of {name} (tol 1e-4)"


def test_chunk_size_dividing_t_exactly():
    model = tiny_model(position="rope")
    idx = torch.randint(0, 32, (3, 16))
    targets = torch.randint(0, 32, (3, 16))
    ref = run(model, idx, targets, "dense", 4, True)
    got = run(model, idx, targets, "chunked", 4, True)
    assert rel_err(got[0], ref[0]) < 1e-5
    for name, g in got[3].items():
        assert rel_err(g, ref[3][name]) < 1e-4, name


def test_auto_cost_model_picks_dense_short_chunked_long():
    assert choose_executor(64, 512, 128, 64) == "dense"
    assert choose_executor(256, 512, 128, 64) == "dense"
    assert choose_executor(2048, 512, 128, 64) == "chunked"
    assert choose_executor(4096, 2048, 256, 256) == "chunked"
    assert choose_executor(512, 2048, 256, 256) == "dense"


def test_unknown_executor_is_rejected():
    from bdh_train.model.mixer import linear_attention

    q = torch.zeros(1, 1, 2, 4)
    v = torch.zeros(1, 1, 2, 3)
    with pytest.raises(ValueError, match="unknown executor 'fast'"):
        linear_attention(q, v, None, None, "fast", 4)


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
            q, v, rho=None, log_decay=log_decay, need_state=need_state, **chunking
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
        assert rel_err(ref[0], want_out) < 1e-12, "dense output differs from the definition"
        if need_state:
            assert rel_err(ref[1], want_rho) < 1e-12, "dense state differs from the definition"
    for chunk_size in (1, 4, 5, 12, 13, 20):  # 4, 5, 12 leave a ragged last chunk
        got = run(chunked_attention, chunk_size=chunk_size)
        where = f"chunk_size={chunk_size}, {dtype}, tolerance {tol:g}"
        assert rel_err(got[0], ref[0]) < tol, f"chunked output differs from dense ({where})"
        if need_state:
            assert rel_err(got[1], ref[1]) < tol, f"chunked final state differs ({where})"
        assert rel_err(got[2], ref[2]) < tol, f"gradient of q differs ({where})"
        assert rel_err(got[3], ref[3]) < tol, f"gradient of v differs ({where})"
