"""The chunked executor as one autograd Function with a hand-written backward.

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

Resets (a row's new document begins at a token, `ResetMasks`) keep all chunks at once. A
document is a run of tokens, so each mask is a 0/1 factor on one of the terms above: A_k
keeps pairs of one document; V_k is written only by the tokens of chunk k's last document
(the only one later chunks can continue); S_k sums the writes of the chunks whose last
document is still the one open when chunk k begins (a carry matrix per row) and rho0 while
no reset came before chunk k; Q_k reads S_k only up to the chunk's first reset; rho_T takes
S_(K-1) only when the last chunk has no reset. Backward applies the same factors.

A fixed per-head decay d = exp(log_decay) (alibi; `ChunkDecay`) weighs the same terms
instead: A_k by d^(t - s), V_k's writes by d^(C - s) (the last chunk's by d^(L - s) for its
L real tokens), the carry of W_j into S_k by d^(C (k - 1 - j)), rho0 into S_k by d^(kC),
token t's read of S_k by d^t and rho_T's of S_(K-1) by d^L; backward applies them where the
reset factors stand. Resets and decay together weigh each term by the product of the two
(`decayed_resets`): a reset drops a term, the decay weighs what stays, and the exponents stay
differences of in-call positions. A learned decay (whose gradient this backward does not
compute) keeps the products under autograd (model/mixer.py).

Queries laid out heads-major (a [B, H, T, N] view of a contiguous [H, B, T, N], as the
layer's projections leave long inputs) run as they lie: every tensor is transposed to
[H, B, ...] (v, the reset masks and the decay factors with them), the products above treat the
two leading dims as one batch, and the outputs are transposed back.

On the CPU this Function's forward and backward take 0.72 of autograd's (403 vs 561 ms at
B=8, H=4, T=2048, N=512, C=128), and with alibi's decay 0.21 (139 vs 626 ms at T=512, B=8).
One chunk of the whole call is the dense executor: there no state is read without rho0 and
W is computed only for the final state. Without resets and decay, and longer than the panel
rows it is given, it computes A in row panels (`panel_forward`, `panel_backward`): the
blocks above the diagonal are never computed, and dQ stays one product over the whole
symmetric (dA + dA^T).
tests/model/test_mixer.py checks it against the token-by-token definition and against the
same products under autograd.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bdh_train.model.matmul import is_heads_major
from bdh_train.model.positions import decay_powers
from bdh_train.model.recording import records_gradient


class ResetMasks(NamedTuple):
    """The factors a reset mask puts on the chunked products (True keeps a term, False drops
    it), for K chunks of C tokens; each broadcasts over the heads (shapes below; [1, B, ...]
    for products laid out heads first). `carry` is a matrix of 0/1 in the queries' dtype (a
    product's operand), the others are bool."""

    pairs: Tensor  # [B, 1, K, C, C]: s < t and both in one document (replaces tril)
    reads: Tensor  # [B, 1, K, C, 1]: t reads S_k (no reset in its chunk up to t)
    writes: Tensor  # [B, 1, K, C, 1]: s is in its chunk's last document (W_k takes it)
    carry: Tensor  # [B, 1, K, K]: S_k takes W_j (j < k, no reset between them)
    from_rho0: Tensor  # [B, 1, K, 1, 1]: S_k takes rho0 (no reset before chunk k)
    final_carries: Tensor  # [B, 1, 1, 1]: rho_T takes S_(K-1) (no reset in the last chunk)


def reset_masks(reset_mask: Tensor, chunk_size: int, dtype: torch.dtype) -> ResetMasks:
    """`ResetMasks` of a [B, T] reset mask (True where a row's new document begins), the
    last chunk padded with tokens of its last document; `dtype`: the carry matrix's."""
    batch, seq_len = reset_mask.shape
    n_chunks = -(-seq_len // chunk_size)
    starts = F.pad(reset_mask.to(torch.long), (0, n_chunks * chunk_size - seq_len))
    document = starts.cumsum(dim=1).view(batch, n_chunks, chunk_size)
    last = document[:, :, -1]  # the document open at each chunk's end, [B, K]
    first = F.pad(last[:, :-1], (1, 0))  # the document open before each chunk (0 at start)
    local = torch.arange(chunk_size, device=reset_mask.device)
    earlier = local.view(1, -1) < local.view(-1, 1)  # [t, s]: s < t
    pairs = earlier & (document.unsqueeze(3) == document.unsqueeze(2))
    chunk = torch.arange(n_chunks, device=reset_mask.device)
    carry = (chunk.view(-1, 1) > chunk.view(1, -1)) & (first.unsqueeze(2) == last.unsqueeze(1))
    return ResetMasks(
        pairs=pairs.unsqueeze(1),
        reads=(document == first.unsqueeze(2)).view(batch, 1, n_chunks, -1, 1),
        writes=(document == last.unsqueeze(2)).view(batch, 1, n_chunks, -1, 1),
        carry=carry.to(dtype).unsqueeze(1),
        from_rho0=(first == 0).view(batch, 1, n_chunks, 1, 1),
        final_carries=(first[:, -1] == last[:, -1]).view(batch, 1, 1, 1),
    )


class ChunkDecay(NamedTuple):
    """The factors a per-head decay d_h = exp(log_decay_h) puts on the chunked products, for
    K chunks of C tokens, the last with L real tokens; each broadcasts over the batch (shapes
    below; [H, 1, ...] for products laid out heads first). Named as `ResetMasks`' fields
    where they stand on the same terms."""

    scores: Tensor  # [1, H, 1, C, C]: d^(t - s), token t's weight on an earlier s in its chunk
    reads: Tensor  # [1, H, 1, C, 1]: d^t, token t's weight on S_k
    writes: Tensor  # [1, H, K, C, 1]: d^(C - s) (last chunk d^(L - s); padding's q, v are 0)
    carry: Tensor  # [1, H, K, K]: d^(C (k - 1 - j)) for j < k, else 0
    from_rho0: Tensor  # [1, H, K, 1, 1]: d^(k C)
    final_carries: Tensor  # [1, H, 1, 1]: d^L, rho_T's weight on S_(K-1)


def chunk_decay(log_decay: Tensor, seq_len: int, chunk_size: int, like: Tensor) -> ChunkDecay:
    """`ChunkDecay` of per-head log-decays [H] (float64), in `like`'s dtype and device
    (`decay_powers`: float64 powers of integer exponents, rounded once)."""
    c = chunk_size
    n_chunks = -(-seq_len // c)
    last = seq_len - (n_chunks - 1) * c
    local = torch.arange(c, device=like.device)
    chunk = torch.arange(n_chunks, device=like.device)
    lengths = torch.full((n_chunks, 1), c, device=like.device)
    lengths[-1] = last
    remaining = lengths - local  # [K, C]: L_k - s, real tokens where > 0
    later = chunk.view(-1, 1) - 1 - chunk  # [K, K]: k - 1 - j
    gap = (local.view(-1, 1) - local).clamp_min(0)  # [C, C]: t - s where s < t

    def powers(exponents: Tensor, keep: Tensor | None = None) -> Tensor:
        values = decay_powers(log_decay, exponents, like)  # [H, *exponents.shape]
        return values if keep is None else torch.where(keep, values, 0.0)

    return ChunkDecay(
        scores=powers(gap).unsqueeze(0).unsqueeze(2),
        reads=powers(local).view(1, -1, 1, c, 1),
        writes=powers(remaining.clamp_min(0)).unsqueeze(0).unsqueeze(-1),
        carry=powers(c * later.clamp_min(0), later >= 0).unsqueeze(0),
        from_rho0=powers(c * chunk).view(1, -1, n_chunks, 1, 1),
        final_carries=powers(lengths[-1]).view(1, -1, 1, 1),
    )


def decayed_resets(masks: ResetMasks, decay: ChunkDecay) -> ChunkDecay:
    """The factors of resets and a decay together: each of `decay`'s factors times the reset
    mask on the same term (the fields align by position; `pairs` also keeps only s < t), so
    each term keeps its decay where the reset rule keeps it and is 0 where a reset drops it.
    Every factor takes both the batch and the heads dimension ([B, H, ...])."""
    return ChunkDecay(*(weights * kept for weights, kept in zip(decay, masks, strict=True)))


Factors = ResetMasks | ChunkDecay


def _weigh_scores(scores: Tensor, factors: Factors | None) -> None:
    """Causal scores (or their gradient) [B, H, K, C, C] in place: s < t of one document
    under resets, d^(t - s) under decay."""
    if isinstance(factors, ResetMasks):
        scores.masked_fill_(~factors.pairs, 0)
        return
    if factors is not None:
        scores.mul_(factors.scores)
    scores.tril_(diagonal=-1)


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


def _carry_product(carry: Tensor, parts: Tensor) -> Tensor:
    """carry [..., K, K] @ parts [B, H, K, N, D] over the chunk dimension -> [B, H, K, N, D]."""
    return torch.matmul(carry, parts.flatten(-2)).view_as(parts)


def carry_sums(parts: Tensor, earlier: bool) -> Tensor:
    """For parts [B, H, K, N, D], each chunk's sum of the parts of the chunks before it
    (`earlier`: S = carry @ W) or after it (carry^T @ dS), 0 for the first (last) chunk: one
    [K, K] product over the K parts."""
    carry = _carry_matrix(parts.shape[2], parts)
    return _carry_product(carry if earlier else carry.transpose(0, 1), parts)


def running_sums(parts: Tensor, earlier: bool) -> Tensor:
    """`carry_sums` as a running sum, K - 1 adds of one chunk's [B, H, N, D]."""
    n_chunks = parts.shape[2]
    order = list(range(n_chunks)) if earlier else list(range(n_chunks - 1, -1, -1))
    sums = torch.empty_like(parts)
    sums[:, :, order[0]].zero_()
    for previous, k in itertools.pairwise(order):
        torch.add(sums[:, :, previous], parts[:, :, previous], out=sums[:, :, k])
    return sums


def sums_by_product(device_type: str) -> bool:
    """Whether the Function's unweighted chunk states (no resets, no decay: those weigh the
    [K, K] factor, which stays a product) are `carry_sums` on a device, or `running_sums`.
    Both are memory-bound passes over the K parts. On an AMD EPYC (2 threads) the product
    ran 3.7x slower (2.75 against 0.74 ms for B*H = 8, K = 16, N*D = 65536; 2.5x at
    B*H = 32), and a whole L4 D128 N512 train step at T=2048 1.04x faster with the sums; on
    an Intel Xeon the sums had run 1.2x slower than the product (13.6 against 11.3 ms at
    B*H = 32), a term of about 1% of that step. On a GPU the product is one kernel instead
    of K - 1."""
    return device_type != "cpu"


def _sums_of_others(parts: Tensor, earlier: bool) -> Tensor:
    if sums_by_product(parts.device.type):
        return carry_sums(parts, earlier)
    return running_sums(parts, earlier)


def _in_panels(n_chunks: int, chunk_size: int, factors: Factors | None, panel_rows: int) -> bool:
    """Whether a call's scores are computed in row panels: one chunk (dense) longer than a
    panel, without resets or decay."""
    return n_chunks == 1 and factors is None and 0 < panel_rows < chunk_size


def panel_forward(q_rows: Tensor, v_rows: Tensor, panel_rows: int) -> tuple[Tensor, list[Tensor]]:
    """(tril(Q Q^T, -1) V [R, T, D], the score panels) for q_rows [R, T, N], v_rows [R, T, D].
    Panel p holds query rows start..end of the scores against keys 0..end only (its last
    block the causal one), so the blocks above the diagonal are never computed: with m
    panels, (m + 1) / 2m of the full matrix's products."""
    out = v_rows.new_empty(v_rows.shape)
    panels = []
    seq_len = q_rows.shape[1]
    for start in range(0, seq_len, panel_rows):
        end = min(start + panel_rows, seq_len)
        scores = torch.bmm(q_rows[:, start:end], q_rows[:, :end].transpose(1, 2))
        scores[:, :, start:].tril_(diagonal=-1)
        panels.append(scores)
        torch.bmm(scores, v_rows[:, :end], out=out[:, start:end])
    return out, panels


def panel_backward(
    q_rows: Tensor, v_rows: Tensor, d_out_rows: Tensor, panels: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """(dQ, dV) of `panel_forward`'s output. dQ = (dA + dA^T) Q stays one product: panel by
    panel, dA's blocks are written below the diagonal and their transposes above it, so the
    symmetric [R, T, T] matrix is built without a pass that adds a transposed copy of it
    (on the CPU such a pass read T x T strided, 2-3% of an L4 D128 H4 N512 train step at
    T=512). dV sums each panel's A_p^T dOut_p over the keys it reaches."""
    rows, seq_len, _ = q_rows.shape
    d_scores = q_rows.new_empty(rows, seq_len, seq_len)
    d_v = q_rows.new_zeros(v_rows.shape)
    for scores in panels:  # [R, rows, keys]: query rows keys - rows .. keys
        end = scores.shape[2]
        start = end - scores.shape[1]
        block = d_scores[:, start:end, :end]
        torch.bmm(d_out_rows[:, start:end], v_rows[:, :end].transpose(1, 2), out=block)
        diagonal = block[:, :, start:].tril_(diagonal=-1)
        diagonal.add_(diagonal.transpose(1, 2).clone())
        d_scores[:, :start, start:end].copy_(block[:, :, :start].transpose(1, 2))
        d_v[:, :end].baddbmm_(scores.transpose(1, 2), d_out_rows[:, start:end])
    return torch.bmm(d_scores, q_rows), d_v


def chunked_forward(
    qc: Tensor,
    vc: Tensor,
    rho0: Tensor | None,
    final_state: bool,
    factors: Factors | None,
    panel_rows: int,
) -> tuple[Tensor, Tensor | list[Tensor], Tensor | None, Tensor | None]:
    """(out [B, H, K, C, D], A, S or None, W or None) for chunked queries qc [B, H, K, C, N]
    and values vc [B, H, K, C, D] (or all heads first: qc [H, B, ...], vc [H, B, ...]). One
    chunk (the dense executor) computes W only for the final state and has no S without
    rho0; longer than `panel_rows` (and without resets or decay) it computes A in row panels
    (`panel_forward`: a list of [B*H, rows, keys] panels in place of A)."""
    batch, heads, n_chunks, c, n = qc.shape
    d = vc.shape[-1]
    if _in_panels(n_chunks, c, factors, panel_rows):
        q_rows = qc.reshape(batch * heads, c, n)
        v_rows = vc.reshape(batch * heads, c, d)
        out_rows, panels = panel_forward(q_rows, v_rows, panel_rows)
        out = out_rows.view(batch, heads, 1, c, d)
        states, writes = _states_and_writes(qc, vc, rho0, final_state, None)
        _add_reads(out, qc, states, None)
        return out, panels, states, writes
    scores = torch.matmul(qc, qc.transpose(-1, -2))  # A, [B, H, K, C, C]
    _weigh_scores(scores, factors)
    states, writes = _states_and_writes(qc, vc, rho0, final_state, factors)
    out = torch.matmul(scores, vc)  # [B, H, K, C, D]
    _add_reads(out, qc, states, factors)
    return out, scores, states, writes


def _states_and_writes(
    qc: Tensor, vc: Tensor, rho0: Tensor | None, final_state: bool, factors: Factors | None
) -> tuple[Tensor | None, Tensor | None]:
    """(S, W) of the chunks: W only where a later chunk or the final state reads it, S only
    where some chunk reads a state (more than one chunk, or rho0)."""
    n_chunks = qc.shape[2]
    writes = None
    if n_chunks > 1 or final_state:
        written = vc if factors is None else vc * factors.writes
        writes = torch.matmul(qc.transpose(-1, -2), written)  # W, [B, H, K, N, D]
    states = None
    if n_chunks > 1:
        assert writes is not None
        if factors is None:
            states = _sums_of_others(writes, earlier=True)  # S without rho0
        else:
            states = _carry_product(factors.carry, writes)  # S without rho0
        if rho0 is not None:
            rho0_part = rho0.unsqueeze(2)
            states.add_(rho0_part if factors is None else rho0_part * factors.from_rho0)
    elif rho0 is not None:
        states = rho0.unsqueeze(2)  # [B, H, 1, N, D]: no reset, no decay before chunk 0
    return states, writes


def _add_reads(out: Tensor, qc: Tensor, states: Tensor | None, factors: Factors | None) -> None:
    """out [B, H, K, C, D] += each token's read of its chunk's state, Q_k S_k."""
    if states is None:
        return
    batch, heads, n_chunks, c, n = qc.shape
    rows, d = batch * heads * n_chunks, out.shape[-1]
    if factors is None:
        out.view(rows, c, d).baddbmm_(qc.reshape(rows, c, n), states.reshape(rows, n, d))
    else:
        out.add_(torch.matmul(qc, states).mul_(factors.reads))


def _final_state(states: Tensor | None, writes: Tensor | None, factors: Factors | None) -> Tensor:
    """rho_T = S_(K-1) + W_(K-1), S_(K-1) dropped by a reset in the last chunk or decayed
    over its L tokens."""
    assert writes is not None
    if states is None:
        return writes[:, :, -1]
    carried = states[:, :, -1]
    if factors is not None:
        carried = carried * factors.final_carries
    return carried + writes[:, :, -1]


def _run_forward(
    q: Tensor,
    v: Tensor,
    rho0: Tensor | None,
    chunk_size: int,
    final_state: bool,
    reset_mask: Tensor | None,
    heads_first: bool,
    log_decay: Tensor | None,
    panel_rows: int,
) -> tuple[
    Tensor,
    Tensor | None,
    tuple[Tensor, Tensor, Tensor | list[Tensor], Tensor | None],
    Factors | None,
]:
    """(out [B, H, T, D], rho_T or None, what backward needs: (qc, vc, A or its panels, S),
    the reset masks, the decay factors, both's products or None) of the executor's forward;
    `heads_first`: the tensors are laid out [H, B, ...] (the reset mask stays [B, T])."""
    batch, heads, seq_len, _ = q.shape
    resets = None if reset_mask is None else reset_masks(reset_mask, chunk_size, q.dtype)
    factors: Factors | None = resets
    if log_decay is not None:
        decay = chunk_decay(log_decay, seq_len, chunk_size, q)
        factors = decay if resets is None else decayed_resets(resets, decay)
    if heads_first and factors is not None:  # batch and heads swap places in every factor
        factors = type(factors)(*(f.transpose(0, 1) for f in factors))
    qc, vc = _pad_to_chunks(q, chunk_size), _pad_to_chunks(v, chunk_size)
    # a value shared by the heads is copied to every head once here, and saved so for
    # backward (H times the [B, T, D] value; its products and backward's would each
    # broadcast it into a copy of their own)
    vc = vc.expand(*qc.shape[:-1], vc.shape[-1]).contiguous()
    out, scores, states, writes = chunked_forward(qc, vc, rho0, final_state, factors, panel_rows)
    final = _final_state(states, writes, factors) if final_state else None
    out = out.view(batch, heads, -1, out.shape[-1])[:, :, :seq_len]
    return out, final, (qc, vc, scores, states), factors


class ChunkedAttention(torch.autograd.Function):
    """(out [B, H, T, D], rho_T or None) of the chunked executor (resets, decay, or both); see the
    module's docstring for the products of forward and backward."""

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        v: Tensor,
        rho0: Tensor | None,
        chunk_size: int,
        final_state: bool,
        reset_mask: Tensor | None,
        heads_first: bool,
        log_decay: Tensor | None,
        panel_rows: int,
    ) -> tuple[Tensor, Tensor | None]:
        out, final, (qc, vc, scores, states), factors = _run_forward(
            q, v, rho0, chunk_size, final_state, reset_mask, heads_first, log_decay, panel_rows
        )
        panels = scores if isinstance(scores, list) else [scores]
        ctx.save_for_backward(qc, vc, states, *panels)
        ctx.in_panels = isinstance(scores, list)
        ctx.shape = (q.shape[2], v.shape, rho0 is not None)
        ctx.factors = factors
        ctx.set_materialize_grads(False)
        return out, final

    @staticmethod
    @once_differentiable  # saved products are not recorded: a second order would be wrong
    def backward(ctx, d_out: Tensor | None, d_final: Tensor | None):
        qc, vc, states, *panels = ctx.saved_tensors
        seq_len, v_shape, has_rho0 = ctx.shape
        factors: Factors | None = ctx.factors
        batch, heads, n_chunks, c, n = qc.shape
        d = vc.shape[-1]
        rows = batch * heads * n_chunks
        if d_out is None:
            d_out = qc.new_zeros(batch, heads, seq_len, d)
        d_out_c = _pad_to_chunks(d_out, c)
        values = vc.reshape(rows, c, d)
        d_out_rows = d_out_c.reshape(rows, c, d)
        q_rows = qc.reshape(rows, c, n)

        if ctx.in_panels:
            d_q, d_v = panel_backward(q_rows, values, d_out_rows, panels)
        else:
            (scores,) = panels
            d_scores = torch.bmm(d_out_rows, values.transpose(1, 2))
            _weigh_scores(d_scores.view(batch, heads, n_chunks, c, c), factors)
            d_q = torch.bmm(d_scores + d_scores.transpose(1, 2), q_rows)  # [rows, C, N]
            d_v = torch.bmm(scores.view(rows, c, c).transpose(1, 2), d_out_rows)
        d_read = d_out_c if factors is None else d_out_c * factors.reads  # dOut where S is read
        d_read_rows = d_read.reshape(rows, c, d)
        if states is not None:
            d_q.baddbmm_(d_read_rows, states.reshape(rows, n, d).transpose(1, 2))
        d_states = None
        if n_chunks > 1 or has_rho0:
            d_states = torch.matmul(qc.transpose(-1, -2), d_read)  # [B, H, K, N, D]
            if d_final is not None:
                carried = d_final if factors is None else d_final * factors.final_carries
                d_states[:, :, -1] += carried
        d_writes = None
        if n_chunks > 1:
            assert d_states is not None
            if factors is None:
                d_writes = _sums_of_others(d_states, earlier=False)
            else:
                d_writes = _carry_product(factors.carry.transpose(-1, -2), d_states)
            if d_final is not None:
                d_writes[:, :, -1] += d_final
        elif d_final is not None:
            d_writes = d_final.unsqueeze(2)  # [B, H, 1, N, D]
        if d_writes is not None:
            d_writes_rows = d_writes.reshape(rows, n, d)
            written = values
            if factors is not None:  # V weighed per writing token, and so its dV
                writes = factors.writes.expand(batch, heads, n_chunks, c, 1)
                written = values * writes.reshape(rows, c, 1)
                d_v.view(batch, heads, n_chunks, c, d).add_(
                    torch.matmul(qc, d_writes).mul_(factors.writes)
                )
            else:
                d_v.baddbmm_(q_rows, d_writes_rows)
            d_q.baddbmm_(written, d_writes_rows.transpose(1, 2))
        d_v = d_v.view(batch, heads, n_chunks * c, d)[:, :, :seq_len]
        if d_v.shape != v_shape:  # a value shared by the heads: the sum of theirs
            d_v = d_v.sum_to_size(v_shape)
        d_rho0 = None
        if has_rho0 and d_states is not None:
            from_rho0 = d_states if factors is None else d_states * factors.from_rho0
            d_rho0 = from_rho0.sum(dim=2)
        d_q = d_q.view(batch, heads, n_chunks * c, n)[:, :, :seq_len]
        return d_q, d_v, d_rho0, None, None, None, None, None, None


def chunked_attention_function(
    q: Tensor,
    v: Tensor,
    initial_state: Tensor | None,
    chunk_size: int,
    final_state: bool,
    reset_mask: Tensor | None,
    log_decay: Tensor | None,
    panel_rows: int,
) -> tuple[Tensor, Tensor | None]:
    """The chunked executor through `ChunkedAttention` when a gradient is recorded, else its
    forward alone (nothing saved). `reset_mask` [B, T] (True where a row's new document
    begins) drops a row's state before it; `log_decay` [H] (no gradient) decays the state
    per head and token; `panel_rows` > 0: one chunk (the dense executor) longer than that
    computes its scores in row panels of that many queries."""
    if reset_mask is not None:
        reset_mask = reset_mask.to(q.device)
    heads_first = is_heads_major(q)
    if heads_first:  # run on the [H, B, ...] layout as it lies; the outputs go back to [B, H]
        q, v = q.transpose(0, 1), v.transpose(0, 1)
        if initial_state is not None:
            initial_state = initial_state.transpose(0, 1)
    args = (
        q,
        v,
        initial_state,
        chunk_size,
        final_state,
        reset_mask,
        heads_first,
        log_decay,
        panel_rows,
    )
    if records_gradient(q, v, initial_state):
        out, final = ChunkedAttention.apply(*args)
    else:
        out, final, _, _ = _run_forward(*args)
    if heads_first:
        out = out.transpose(0, 1)
        final = None if final is None else final.transpose(0, 1).contiguous()
    return out, final
