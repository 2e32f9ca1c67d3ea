"""The incoming state's read and the final state's write of one linear-attention call, and
the same restricted to the call's edges where a fixed decay allows it.

For queries q [B, H, T, N], values v [B, 1, T, D] (shared by the heads), an incoming state
rho0 [B, H, N, D] and a fixed per-head log-decay log d [H], a call's state terms are

    read_t  = d^t q_t.rho0                               what token t reads from rho0
    rho_T   = d^T rho0 + sum_s d^(T - s) q_s^T v_s       the final state

with resets as in model/mixer.py: `segment` [B, T] (the call's reset_segments) keeps rho0's
read for the tokens before a row's first reset, the write for the row's last document, and
d^T rho0 for a row without a reset.

`decay_powers` weighs a term d^e with e at or past a head's horizon W_h (`decay_horizons`) by
exactly 0. So with W the largest horizon within the call, every head's read needs only its
first W tokens and its write only its last W, except the heads whose horizon reaches past
the call ("long" heads: alibi_slow's last), which also read the other T - W tokens, write
from the first T - W and carry d^T rho0 (`state_edges`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bdh_train.model.positions import decay_powers


def state_read(
    q: Tensor, rho: Tensor, log_decay: Tensor | None, segment: Tensor | None, start: int = 0
) -> Tensor:
    """What n = q.shape[2] tokens of a call, from its token `start` on (q: those tokens), read
    from its incoming state: d^t q_t.rho0 for t = start .. start + n - 1, 0 from a row's first
    reset on (`segment`: the call's reset segments)."""
    n = q.shape[2]
    q_read = q
    if log_decay is not None:
        t = torch.arange(start, start + n, device=q.device)
        q_read = q * decay_powers(log_decay, t, q).unsqueeze(-1)  # d^t, [H, n, 1]
    from_rho = q_read @ rho
    if segment is not None:  # only the tokens before the row's first reset read rho0
        later = segment[:, start : start + n] != 0
        from_rho = from_rho.masked_fill(later.view(-1, 1, n, 1), 0)
    return from_rho


def state_written(
    q: Tensor, v: Tensor, log_decay: Tensor | None, segment: Tensor | None, before_end: int = 0
) -> Tensor:
    """What n = q.shape[2] tokens of a call, ending `before_end` tokens before its end (q, v:
    those tokens), write into its final state: sum_s d^(T - s) q_s^T v_s, the row's last
    document only (`segment`: the call's reset segments)."""
    n = q.shape[2]
    q_write = q
    if log_decay is not None:
        remaining = n + before_end - torch.arange(n, device=q.device)  # T - s
        q_write = q * decay_powers(log_decay, remaining, q).unsqueeze(-1)
    v_write = v
    if segment is not None:  # the final state holds the last document only
        end = segment.shape[1] - before_end
        earlier = segment[:, end - n : end] != segment[:, -1:]
        v_write = v.masked_fill(earlier.view(-1, 1, n, 1), 0)  # [B, 1, n, D]: cheaper than q
    return q_write.transpose(-1, -2) @ v_write


def state_carried(
    rho: Tensor, log_decay: Tensor | None, seq_len: int, segment: Tensor | None
) -> Tensor:
    """What of the incoming state a call of `seq_len` tokens carries into its final state:
    d^T rho0, 0 in a row with a reset (`segment`: the call's reset segments)."""
    carried = rho
    if log_decay is not None:
        total = torch.tensor([seq_len], device=rho.device)
        carried = rho * decay_powers(log_decay, total, rho).view(1, -1, 1, 1)
    if segment is not None:
        carried = carried.masked_fill((segment[:, -1] != 0).view(-1, 1, 1, 1), 0)
    return carried


def edge_split(horizons: tuple[int, ...], seq_len: int) -> tuple[int, list[int]]:
    """(W, the long heads): W the largest horizon within the call, the long heads those whose
    horizon (capped at `seq_len`) reaches its end."""
    w = max(h for h in horizons if h < seq_len)
    return w, [head for head, h in enumerate(horizons) if h == seq_len]


def state_edges(
    out: Tensor,
    q: Tensor,
    v: Tensor,
    rho: Tensor | None,
    log_decay: Tensor,
    segment: Tensor | None,
    horizons: tuple[int, ...],
    final: bool,
) -> tuple[Tensor, Tensor | None]:
    """`out` (the call's own tokens' output) plus rho0's read, and the final state when
    `final`: every head's first and last W tokens, the long heads' others (`edge_split`).

    The heads are not split apart: every head takes the first W tokens in one read and the
    last W in one write, and the long heads alone (index_select) the rest; without long
    heads (alibi) that is one read and one write of every head, as fast as before. A read
    and a write for each run of heads (alibi_slow's three fast heads, then its slow one)
    measured 1.03-1.06x the whole call's speed on the demo's step against 1.05-1.08x this
    way, inside the runs' spread, but it splits q by heads (products over such a slice copy
    it); the same terms as an autograd Function with a hand-written backward ran at 1.00x
    (`bench_state_edges.py`'s model, 2026-12-07)."""
    seq_len = q.shape[2]
    w, long_heads = edge_split(horizons, seq_len)
    rest = seq_len - w  # the tokens only the long heads read (the last) and write (the first)
    if long_heads:  # taken out once: each index_select's backward fills a zeroed q-sized gradient
        index = torch.tensor(long_heads, device=q.device)
        q_long, decay_long = q.index_select(1, index), log_decay[long_heads]
        rho_long = None if rho is None else rho.index_select(1, index)
    if rho is not None:
        tail = out[:, :, w:]
        if long_heads and rho_long is not None:
            late = state_read(q_long[:, :, w:], rho_long, decay_long, segment, start=w)
            tail = tail.index_add(1, index, late)
        out = torch.cat([out[:, :, :w] + state_read(q[:, :, :w], rho, log_decay, segment), tail], 2)
    if not final:
        return out, None
    state = state_written(q[:, :, rest:], v[:, :, rest:], log_decay, segment)
    if long_heads:
        early = state_written(q_long[:, :, :rest], v[:, :, :rest], decay_long, segment, w)
        if rho_long is not None:
            early = early + state_carried(rho_long, decay_long, seq_len, segment)
        state = state.index_add(1, index, early)
    return out, state
