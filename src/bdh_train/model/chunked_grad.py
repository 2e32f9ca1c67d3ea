"""The chunked executor without decay as one autograd Function with a hand-written backward.

For queries q [B, H, T, N] (keys are the queries), values v [B, 1|H, T, D] and an incoming
state rho0 [B, H, N, D] (or none), cut into K chunks of C tokens (the last zero-padded):

    A_k   = tril(Q_k Q_k^T, -1)                the chunk's causal scores      [C, C]
    W_k   = Q_k^T V_k                          what chunk k writes            [N, D]
    S_k   = rho0 + sum_(j<k) W_j               the state chunk k reads        [N, D]
    out_k = A_k V_k + Q_k S_k                                                 [C, D]
    rho_T = S_(K-1) + W_(K-1)

Autograd through these products sees Q four times (both sides of Q Q^T, the write, the read)
and so computes Q Q^T's gradient as two products, each of Q's four gradients as a separate
tensor, and three [B, H, T, N] sums of them. The backward here uses that A is symmetric
before masking, dQ_k = (dA + dA^T) Q_k, and accumulates the other terms into the same buffer
with baddbmm:

    dA_k  = tril(dOut_k V_k^T, -1)
    dS_k  = Q_k^T dOut_k  (+ d rho_T for k = K-1)
    dW_j  = sum_(k>j) dS_k  (+ d rho_T for j = K-1)
    dQ_k  = (dA_k + dA_k^T) Q_k + dOut_k S_k^T + V_k dW_k^T
    dV_k  = A_k^T dOut_k + Q_k dW_k       (summed over heads when v is shared)
    d rho0 = sum_k dS_k

On the CPU this Function's forward and backward take 0.72 of autograd's (403 vs 561 ms at
B=8, H=4, T=2048, N=512, C=128). One chunk of the whole call is the dense executor without
decay: there no state is read without rho0 and W is computed only for the final state.
tests/model/test_mixer.py checks it against the token-by-token definition and against the
same products under autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _pad_to_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """x [B, H, T, .] zero-padded along T to whole chunks and viewed [B, H, K, C, .]."""
    batch, heads, seq_len, width = x.shape
    n_chunks = -(-seq_len // chunk_size)
    pad = n_chunks * chunk_size - seq_len
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.view(batch, heads, n_chunks, chunk_size, width)


def _carry_matrix(n_chunks: int, like: Tensor) -> Tensor:
    """[K, K] with 1 where j < k: S = carry @ W sums every earlier chunk's write."""
    index = torch.arange(n_chunks, device=like.device)
    return (index.view(-1, 1) > index.view(1, -1)).to(like.dtype)


def chunked_forward(
    qc: Tensor, vc: Tensor, rho0: Tensor | None, final_state: bool
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(out [B, H, K, C, D], A, S or None, W or None) for chunked queries qc [B, H, K, C, N]
    and values vc [B, 1|H, K, C, D]. One chunk (the dense executor) computes W only for the
    final state and has no S without rho0."""
    batch, heads, n_chunks, c, n = qc.shape
    d = vc.shape[-1]
    scores = torch.matmul(qc, qc.transpose(-1, -2)).tril_(diagonal=-1)  # A, [B, H, K, C, C]
    writes = None
    if n_chunks > 1 or final_state:
        writes = torch.matmul(qc.transpose(-1, -2), vc)  # W, [B, H, K, N, D]
    states = None
    if n_chunks > 1:
        assert writes is not None
        states = torch.matmul(_carry_matrix(n_chunks, qc), writes.flatten(-2))
        states = states.view(batch, heads, n_chunks, n, d)  # S without rho0
        if rho0 is not None:
            states.add_(rho0.unsqueeze(2))
    elif rho0 is not None:
        states = rho0.unsqueeze(2)  # [B, H, 1, N, D]
    out = torch.matmul(scores, vc)  # [B, H, K, C, D]
    if states is not None:
        rows = batch * heads * n_chunks
        out.view(rows, c, d).baddbmm_(qc.reshape(rows, c, n), states.reshape(rows, n, d))
    return out, scores, states, writes


def _final_state(states: Tensor | None, writes: Tensor | None) -> Tensor:
    """rho_T = S_(K-1) + W_(K-1)."""
    assert writes is not None
    return writes[:, :, -1] if states is None else states[:, :, -1] + writes[:, :, -1]


class ChunkedAttention(torch.autograd.Function):
    """(out [B, H, T, D], rho_T or None) of the chunked executor without decay; see the
    module's docstring for the products of forward and backward."""

    @staticmethod
    def forward(
        ctx, q: Tensor, v: Tensor, rho0: Tensor | None, chunk_size: int, final_state: bool
    ) -> tuple[Tensor, Tensor | None]:
        batch, heads, seq_len, _ = q.shape
        qc, vc = _pad_to_chunks(q, chunk_size), _pad_to_chunks(v, chunk_size)
        out, scores, states, writes = chunked_forward(qc, vc, rho0, final_state)
        final = _final_state(states, writes) if final_state else None
        ctx.save_for_backward(qc, vc, scores, states)
        ctx.shape = (seq_len, v.shape[1], rho0 is not None)
        ctx.set_materialize_grads(False)
        out = out.view(batch, heads, -1, out.shape[-1])[:, :, :seq_len]
        return out, final

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_final: Tensor | None):
        qc, vc, scores, states = ctx.saved_tensors
        seq_len, value_heads, has_rho0 = ctx.shape
        batch, heads, n_chunks, c, n = qc.shape
        d = vc.shape[-1]
        rows = batch * heads * n_chunks
        if d_out is None:
            d_out = qc.new_zeros(batch, heads, seq_len, d)
        d_out_c = _pad_to_chunks(d_out, c)
        values = vc.expand(batch, heads, n_chunks, c, d).reshape(rows, c, d)
        d_out_rows = d_out_c.reshape(rows, c, d)
        q_rows = qc.reshape(rows, c, n)

        d_scores = torch.bmm(d_out_rows, values.transpose(1, 2)).tril_(diagonal=-1)
        d_q = torch.bmm(d_scores + d_scores.transpose(1, 2), q_rows)  # [rows, C, N]
        if states is not None:
            d_q.baddbmm_(d_out_rows, states.reshape(rows, n, d).transpose(1, 2))
        d_states = None
        if n_chunks > 1 or has_rho0:
            d_states = torch.matmul(qc.transpose(-1, -2), d_out_c)  # [B, H, K, N, D]
            if d_final is not None:
                d_states[:, :, -1] += d_final
        d_writes = None
        if n_chunks > 1:
            assert d_states is not None
            carry = _carry_matrix(n_chunks, qc)
            d_writes = torch.matmul(carry.t(), d_states.flatten(-2)).view_as(d_states)
            if d_final is not None:
                d_writes[:, :, -1] += d_final
        elif d_final is not None:
            d_writes = d_final.unsqueeze(2)  # [B, H, 1, N, D]
        d_v = torch.bmm(scores.view(rows, c, c).transpose(1, 2), d_out_rows)
        if d_writes is not None:
            d_writes_rows = d_writes.reshape(rows, n, d)
            d_q.baddbmm_(values, d_writes_rows.transpose(1, 2))
            d_v.baddbmm_(q_rows, d_writes_rows)
        d_v = d_v.view(batch, heads, n_chunks * c, d)
        if value_heads == 1:
            d_v = d_v.sum(dim=1, keepdim=True)
        d_rho0 = d_states.sum(dim=2) if has_rho0 and d_states is not None else None
        d_q = d_q.view(batch, heads, n_chunks * c, n)[:, :, :seq_len]
        return d_q, d_v[:, :, :seq_len], d_rho0, None, None


def chunked_attention_without_decay(
    q: Tensor, v: Tensor, initial_state: Tensor | None, chunk_size: int, final_state: bool
) -> tuple[Tensor, Tensor | None]:
    """The chunked executor without decay: through `ChunkedAttention` when a gradient is
    recorded, else its forward alone (nothing saved)."""
    inputs = (q, v) if initial_state is None else (q, v, initial_state)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return ChunkedAttention.apply(q, v, initial_state, chunk_size, final_state)
    batch, heads, seq_len, _ = q.shape
    out, _, states, writes = chunked_forward(
        _pad_to_chunks(q, chunk_size), _pad_to_chunks(v, chunk_size), initial_state, final_state
    )
    final = _final_state(states, writes) if final_state else None
    return out.view(batch, heads, -1, out.shape[-1])[:, :, :seq_len], final
