"""Causal linear attention with a carried state, in three equivalent executors.

All executors compute, for queries q [B,H,T,N] (keys are the queries), values v [B,1,T,D]
(shared by all heads), an incoming state rho0 [B,H,N,D] (None = zeros) and an optional
per-head log-decay log d [H] (None = no decay, d = 1):

    out_t = d^t q_t.rho0 + sum_{s<t} d^(t-s) (q_t.q_s) v_s
    rho_T = d^T rho0 + sum_s d^(T-s) q_s^T v_s

t and s count from 0 within the call, T is the call's length. Token t reads the state before
writing itself into it (the strict s < t), and the state decays once per token, the last one
included: a token's contribution has decayed by d by the time the next token reads it.

An optional reset mask [B, T] (bool) marks where a new document begins in a row: at such a
position the row drops everything before it, the incoming rho0 and every earlier token, as if
the call had started there from a zero state. With segment(b, t) = the number of resets at or
before t, token t reads rho0 only while segment(b, t) = 0, reads token s only when
segment(b, s) = segment(b, t), and the final state holds only the last segment (plus rho0
when the row has no reset). Decay exponents stay differences of in-call positions, so a reset
changes nothing else.

Every executor has the same keyword signature,

    fn(q, v, *, initial_state=None, log_decay=None, chunk_size=256, output_final_state=True,
       reset_mask=None)
        -> (out [B,H,T,D], final state [B,H,N,D] or None)

* dense     - the T x T masked score matrix; O(T^2 (N+D)) work, O(T^2) memory.
              Ignores chunk_size.
* chunked   - dense inside chunks of chunk_size tokens, the state carried between chunks;
              O(T (C (N+D) + 2 N D)) work, O(T C) score memory.
* recurrent - token by token, read before write (the definition; generation). Ignores
              chunk_size and always returns the final state.

With output_final_state=False, dense and chunked skip the final state's computation and
return None for it. `linear_attention` dispatches by name through EXECUTOR_FUNCTIONS; under
a fixed decay where some head's powers are all 0 past a horizon shorter than the call, it
runs a dense call over the call's own tokens and reads and writes the state of those heads at
the call's edges only (`_with_state_edges`), which gives what the whole call gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bdh_train.model.chunked_grad import chunked_attention_function
from bdh_train.model.matmul import is_heads_major
from bdh_train.model.positions import decay_horizons, decay_powers
from bdh_train.model.state_edges import state_carried, state_edges, state_read, state_written

DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class ExecutorCalibration:
    """How 'auto' runs on one kind of device, from measured train steps."""

    chunk_size: int
    """The chunk length chunked runs with when the model's chunk_size is 0."""
    chunked_margin: float
    """How much cheaper (in multiply-adds) chunked must count to be chosen over dense."""
    dense_panel_rows: int = 0
    """The dense executor computes its causal scores in row panels of this many queries,
    skipping the blocks above the diagonal (0: the whole T x T matrix at once)."""


# CPU: config L4 D128 H4 N512, fp32, 2 threads, batch 8, train steps alternating in one
# process: C=128 was the fastest chunk at T=512, 1024, 2048 and 4096 (C=64 and 256 3-12%
# slower; at T=2048 B=2 after the panels: C=64 0.98x, C=256 0.92x). Dense in row panels of
# 128 (1.07x the whole matrix at T=512 B=8, 1.035x on L6 D256 H4 N2048 at T=512, 1.055x at
# T=1024; panels of 64 and 256 within 1% of 128) was faster than C=128 at T=512 (1.03x; L6
# D256: 1.32x) and at T=1024 on L6 D256 (1.06x), slower at T=768 (0.89x) and on L6 D256 at
# T=1536 (0.93x): margins from 0.99 to 1.34 pick the faster at every one of these points,
# x1.15 is taken. Those points were measured on an Intel Xeon; on an AMD EPYC (same torch and
# MKL) dense/128 was again the fastest at T=512 (L4 D128 B=8 and L6 D256 B=4) and C=128 at
# T=2048 B=2 (C=64 0.97x, C=256 0.91x), so one "cpu" entry serves both.
# CUDA (one H200, fp32, torch 2.11, same configs): C=128 was fastest or within 1.2% of it at
# T=2048 and 8192 (C=64 1% faster on L4 D128 at T=2048; C=256 and 512 4-19% slower); dense
# beat C=128 by 8% at T=512 on L4 D128 and by 33% on L6 D256, where the x1.5 margin would
# pick chunked on L4 D128; x2 keeps dense there and picks chunked at T=2048 (2.1x dense).
# CUDA, bf16 (queries in bf16, as under bf16 autocast): tensor cores make dense's products
# cheap while chunked's extra passes stay memory-bound: dense was 10% faster than C=128 on
# L6 D256 at T=2048 (x2 would pick chunked), chunked 1.4-1.7x dense at T=8192, C=128 and 256
# within 3% of each other; x4 picks the faster at every measured point.
# Other devices have not been measured: they keep the previous default.
EXECUTOR_CALIBRATION: dict[str, ExecutorCalibration] = {
    "cpu": ExecutorCalibration(chunk_size=128, chunked_margin=1.15, dense_panel_rows=128),
    "cuda": ExecutorCalibration(chunk_size=128, chunked_margin=2.0),
    "cuda/bfloat16": ExecutorCalibration(chunk_size=128, chunked_margin=4.0),
}
"""Keyed by device type, or "device type/dtype" where a compute dtype (the queries', or
autocast's) measured differently."""
UNMEASURED_DEVICE = ExecutorCalibration(chunk_size=DEFAULT_CHUNK_SIZE, chunked_margin=1.5)


def calibration_for(device_type: str, dtype: torch.dtype | None = None) -> ExecutorCalibration:
    """The calibration of queries of `dtype` on `device_type` (that of the device type when
    the dtype has none of its own)."""
    if dtype is not None:
        dtype_name = str(dtype).removeprefix("torch.")
        found = EXECUTOR_CALIBRATION.get(f"{device_type}/{dtype_name}")
        if found is not None:
            return found
    return EXECUTOR_CALIBRATION.get(device_type, UNMEASURED_DEVICE)


def dense_keys_per_query(seq_len: int, panel_rows: int) -> float:
    """How many keys dense's products cover per query: T for the whole matrix; in row panels
    of P queries, panel p reaches (p + 1) P keys and a last short panel all T, (T + P) / 2
    on average when P divides T."""
    if panel_rows <= 0 or seq_len <= panel_rows:
        return float(seq_len)
    whole, rest = divmod(seq_len, panel_rows)
    pairs = panel_rows * panel_rows * whole * (whole + 1) // 2 + rest * seq_len
    return pairs / seq_len


def choose_executor(
    seq_len: int,
    n_neurons: int,
    n_embd: int,
    chunk_size: int,
    margin: float = 1.5,
    dense_panel_rows: int = 0,
) -> str:
    """Pick dense or chunked by counting multiply-adds per token and head.

    dense costs K (N + D) per token (score row + weighted sum over K keys: T, or fewer in
    row panels, `dense_keys_per_query`); chunked costs C (N + D) for its chunk plus 2 N D for
    reading and writing the state. Chunking must win by `margin` (its extra passes over the
    chunk states are not in the count) to be chosen.
    """
    if seq_len <= chunk_size:
        return "dense"
    dense_cost = dense_keys_per_query(seq_len, dense_panel_rows) * (n_neurons + n_embd)
    chunked_cost = chunk_size * (n_neurons + n_embd) + 2 * n_neurons * n_embd
    return "chunked" if margin * chunked_cost < dense_cost else "dense"


def resolve_executor(
    executor: str,
    seq_len: int,
    n_neurons: int,
    n_embd: int,
    chunk_size: int,
    device_type: str,
    dtype: torch.dtype | None = None,
    dense_panels: bool = True,
) -> tuple[str, int]:
    """(executor, chunk size) a call runs with: a chunk_size of 0 takes the calibrated chunk
    of the device (and the queries' dtype), and 'auto' resolves through `choose_executor`
    with its margin, counting dense in the calibration's row panels where the call would
    run them (`dense_panels`)."""
    calibration = calibration_for(device_type, dtype)
    chunk_size = chunk_size or calibration.chunk_size
    if executor == "auto":
        executor = choose_executor(
            seq_len,
            n_neurons,
            n_embd,
            chunk_size,
            calibration.chunked_margin,
            calibration.dense_panel_rows if dense_panels else 0,
        )
    return executor, chunk_size


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs products in on `device_type`, or None when it is off there."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _hand_written_backward_applies(q: Tensor, log_decay: Tensor | None) -> bool:
    """Whether dense and chunked run as `ChunkedAttention`: with reset masks, a fixed decay or
    both (not a decay that is learned), outside autocast (its backward would not run under
    it) and outside torch.compile (inductor fuses the autograd form itself)."""
    return (
        (log_decay is None or not log_decay.requires_grad)
        and _autocast_dtype(q.device.type) is None
        and not torch.compiler.is_compiling()
    )


def _dense_panel_rows(q: Tensor, log_decay: Tensor | None, reset_mask: Tensor | None) -> int:
    """The panel rows dense runs a call with: the calibration's for q's device and dtype
    where the Function runs without resets and decay (its panels take neither), else 0 (the
    whole matrix)."""
    if log_decay is not None or reset_mask is not None:
        return 0
    if not _hand_written_backward_applies(q, None):
        return 0
    return calibration_for(q.device.type, q.dtype).dense_panel_rows


def reset_segments(reset_mask: Tensor) -> Tensor:
    """segment(b, t) = resets at or before t in row b ([B, T] long): tokens see each other only
    within one segment, and segment 0 is the one that continues the incoming state."""
    return reset_mask.to(torch.long).cumsum(dim=1)


def dense_attention(
    q: Tensor,
    v: Tensor,
    *,
    initial_state: Tensor | None = None,
    log_decay: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    output_final_state: bool = True,
    reset_mask: Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole call at once through the masked T x T score matrix (chunk_size unused).
    Without a learned decay this is the chunked executor's Function with one chunk, which
    computes the matrix in row panels where `_dense_panel_rows` gives them (the blocks above
    the diagonal skipped)."""
    seq_len = q.shape[2]
    if seq_len > 0 and _hand_written_backward_applies(q, log_decay):
        return chunked_attention_function(
            q,
            v,
            initial_state,
            seq_len,
            output_final_state,
            reset_mask,
            log_decay,
            _dense_panel_rows(q, log_decay, reset_mask),
        )
    rho = initial_state
    segment = None if reset_mask is None else reset_segments(reset_mask.to(q.device))
    scores = q @ q.transpose(-1, -2)
    if log_decay is not None:
        t = torch.arange(seq_len, device=q.device)
        gap = (t.unsqueeze(1) - t.unsqueeze(0)).clamp_min(0)
        scores = scores * decay_powers(log_decay, gap, q)  # [H, T, T]
    if segment is None:
        scores = scores.tril_(diagonal=-1)
    else:  # token t reads token s < t only inside its own document: one pass for both rules
        t = torch.arange(seq_len, device=q.device)
        later = t.unsqueeze(0) >= t.unsqueeze(1)  # s >= t, [T, T]
        hidden = later | (segment.unsqueeze(2) != segment.unsqueeze(1))  # [B, T, T]
        scores = scores.masked_fill_(hidden.unsqueeze(1), 0)
    out = scores @ v
    if rho is not None:
        out = out + state_read(q, rho, log_decay, segment)
    if not output_final_state:
        return out, None
    new_rho = state_written(q, v, log_decay, segment)
    if rho is not None:
        new_rho = state_carried(rho, log_decay, seq_len, segment) + new_rho
    return out, new_rho


def chunked_attention(
    q: Tensor,
    v: Tensor,
    *,
    initial_state: Tensor | None = None,
    log_decay: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    output_final_state: bool = True,
    reset_mask: Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense inside chunks of `chunk_size` tokens; the state carries the past between them.

    All chunks at once, with no loop over them: the sequence is zero-padded to K whole chunks
    of C tokens (a zero query and value add nothing to scores or states) and viewed as
    [B, H, K, C, .]. Then, with chunk k covering positions kC .. kC + C - 1:

        W_k = sum_{s in k} d^(kC + C - s) q_s^T v_s          what chunk k writes
        S_k = d^(kC) rho0 + sum_{j<k} d^(C (k-1-j)) W_j       the state chunk k reads
        out_t = d^(t - kC) q_t.S_k + the chunk's own dense part

    S is one [K, K] matrix product over the chunks' writes, so a call costs a fixed number of
    batched products whatever T is, and its shapes follow T symbolically under torch.compile
    (the Function below takes S without resets or decay as a running sum over the chunks on
    the CPU instead: `chunked_grad.sums_by_product`).
    The final state continues from the last chunk's S with that chunk's real tokens only.
    Outside autocast and torch.compile, the same products run as one autograd Function with
    a backward of fewer products and no [B, H, T, N] gradient sums, resets (0/1 factors), a
    fixed decay (powers) or both (their products) weighing its terms (model/chunked_grad.py).
    Otherwise, and for a learned decay, `chunked_by_products` is the form autograd
    differentiates; with a reset mask the chunks run one after another (`_chunk_by_chunk`).
    """
    if _hand_written_backward_applies(q, log_decay):
        return chunked_attention_function(
            q, v, initial_state, chunk_size, output_final_state, reset_mask, log_decay, 0
        )
    if reset_mask is not None:
        return _chunk_by_chunk(
            q, v, initial_state, log_decay, chunk_size, output_final_state, reset_mask
        )
    return chunked_by_products(q, v, initial_state, log_decay, chunk_size, output_final_state)


def chunked_by_products(
    q: Tensor,
    v: Tensor,
    initial_state: Tensor | None,
    log_decay: Tensor | None,
    chunk_size: int,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunked_attention` without a reset mask, as products autograd differentiates."""
    batch, heads, seq_len, n = q.shape
    d, c = v.shape[-1], chunk_size
    n_chunks = -(-seq_len // c)
    pad = n_chunks * c - seq_len
    if pad:  # padding copies q; a length of whole chunks is only viewed
        q, v = F.pad(q, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    qc = q.view(batch, heads, n_chunks, c, n)
    vc = v.view(batch, v.shape[1], n_chunks, c, d)
    local = torch.arange(c, device=q.device)
    chunk_index = torch.arange(n_chunks, device=q.device)

    scores = qc @ qc.transpose(-1, -2)  # [B, H, K, C, C]
    if log_decay is not None:
        gap = (local.unsqueeze(1) - local.unsqueeze(0)).clamp_min(0)
        scores = scores * decay_powers(log_decay, gap, q).unsqueeze(1)  # [H, 1, C, C]
    out = scores.tril_(diagonal=-1) @ vc

    q_write = (
        qc if log_decay is None else qc * decay_powers(log_decay, c - local, q).view(-1, 1, c, 1)
    )
    writes = (q_write.transpose(-1, -2) @ vc).flatten(-2)  # W_k, [B, H, K, N*D]
    later = chunk_index.unsqueeze(1) - 1 - chunk_index.unsqueeze(0)  # k-1-j, [K, K]
    if log_decay is None:
        carry = (later >= 0).to(q.dtype)
    else:
        carry = decay_powers(log_decay, c * later.clamp_min(0), q) * (later >= 0)
    states = (carry @ writes).view(batch, heads, n_chunks, n, d)  # S_k without rho0
    if initial_state is not None:
        rho = initial_state.unsqueeze(2)  # [B, H, 1, N, D]
        if log_decay is not None:
            rho = rho * decay_powers(log_decay, c * chunk_index, q).view(-1, n_chunks, 1, 1)
        states = states + rho
    q_read = qc if log_decay is None else qc * decay_powers(log_decay, local, q).view(-1, 1, c, 1)
    out = (out + q_read @ states).view(batch, heads, n_chunks * c, d)[:, :, :seq_len]
    if not output_final_state:
        return out, None
    # the last chunk's real tokens s = start .. seq_len - 1 write d^(seq_len - s) q_s^T v_s
    start = (n_chunks - 1) * c
    q_last, carried = q[:, :, start:seq_len], states[:, :, -1]
    if log_decay is not None:
        remaining = seq_len - torch.arange(start, seq_len, device=q.device)
        q_last = q_last * decay_powers(log_decay, remaining, q).unsqueeze(-1)
        total = torch.tensor([seq_len - start], device=q.device)
        carried = carried * decay_powers(log_decay, total, q).view(1, -1, 1, 1)
    return out, carried + q_last.transpose(-1, -2) @ v[:, :, start:seq_len]


def _chunk_by_chunk(
    q: Tensor,
    v: Tensor,
    initial_state: Tensor | None,
    log_decay: Tensor | None,
    chunk_size: int,
    output_final_state: bool,
    reset_mask: Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """chunked_attention with resets inside the call: a loop of dense_attention calls, the
    state carried from one chunk to the next, each chunk applying its columns of the mask.

    The chunks are cut with torch.split: slicing each chunk out of q would make backward
    build one zero-filled gradient of the whole q per chunk (O(T^2 / C) memory traffic);
    split's backward concatenates the chunk gradients once.
    """
    seq_len = q.shape[2]
    chunks = zip(
        torch.split(q, chunk_size, dim=2),
        torch.split(v, chunk_size, dim=2),
        torch.split(reset_mask, chunk_size, dim=1),
        strict=True,
    )
    state, outs, end = initial_state, [], 0
    for q_chunk, v_chunk, mask_chunk in chunks:
        end += q_chunk.shape[2]
        out, state = dense_attention(
            q_chunk,
            v_chunk,
            initial_state=state,
            log_decay=log_decay,
            output_final_state=output_final_state or end < seq_len,
            reset_mask=mask_chunk,
        )
        outs.append(out)
    return torch.cat(outs, dim=2), state


def recurrent_attention(
    q: Tensor,
    v: Tensor,
    *,
    initial_state: Tensor | None = None,
    log_decay: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    output_final_state: bool = True,
    reset_mask: Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, read before write: the definition itself. A reset zeroes the state
    before its token reads it.

    chunk_size is unused and the final state is always returned (it is the loop's carry).
    """
    rho = initial_state
    batch, heads, seq_len, n = q.shape
    d = v.shape[-1]
    if rho is None:
        rho = q.new_zeros(batch, heads, n, d)
    step_decay = None
    if log_decay is not None:
        step_decay = torch.exp(log_decay.to(q.device)).to(q.dtype).view(1, -1, 1, 1)
    outs = []
    for t in range(seq_len):
        if reset_mask is not None:
            rho = rho.masked_fill(reset_mask[:, t].to(q.device).view(-1, 1, 1, 1), 0)
        q_t = q[:, :, t : t + 1]
        outs.append(q_t @ rho)
        rho = rho + q_t.transpose(-1, -2) @ v[:, :, t : t + 1]
        if step_decay is not None:
            rho = rho * step_decay
    return torch.cat(outs, dim=2), rho


Executor = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

# The one list of executors: model config, benchmarks and tests take their names from here.
EXECUTOR_FUNCTIONS: dict[str, Executor] = {
    "dense": dense_attention,
    "chunked": chunked_attention,
    "recurrent": recurrent_attention,
}
EXECUTORS = tuple(EXECUTOR_FUNCTIONS)


def linear_attention(
    q: torch.Tensor,
    v: torch.Tensor,
    *,
    executor: str,
    initial_state: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    chunk_size: int = 0,
    output_final_state: bool = True,
    reset_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one executor by name; 'auto' resolves through `choose_executor`. A chunk_size of 0
    takes the calibrated chunk of q's device type (EXECUTOR_CALIBRATION)."""
    device_type = q.device.type
    compute_dtype = _autocast_dtype(device_type) or q.dtype  # autocast's, whatever q's
    executor, chunk_size = resolve_executor(
        executor,
        q.shape[2],
        q.shape[3],
        v.shape[3],
        chunk_size,
        device_type,
        compute_dtype,
        dense_panels=_dense_panel_rows(q, log_decay, reset_mask) > 0,
    )
    fn = EXECUTOR_FUNCTIONS.get(executor)
    if fn is None:
        raise ValueError(f"unknown executor {executor!r}; expected one of {EXECUTORS} or 'auto'")
    runs_the_function = executor in ("dense", "chunked") and _hand_written_backward_applies(
        q, log_decay
    )
    if is_heads_major(q) and not runs_the_function:
        q = q.contiguous()  # only ChunkedAttention runs on the heads-major layout as it lies
    horizons = state_horizons(q, log_decay, executor, initial_state, output_final_state)
    if horizons is not None and log_decay is not None:
        return _with_state_edges(
            fn, q, v, initial_state, log_decay, chunk_size, output_final_state, reset_mask, horizons
        )
    return fn(
        q,
        v,
        initial_state=initial_state,
        log_decay=log_decay,
        chunk_size=chunk_size,
        output_final_state=output_final_state,
        reset_mask=reset_mask,
    )


def state_horizons(
    q: Tensor,
    log_decay: Tensor | None,
    executor: str,
    initial_state: Tensor | None,
    output_final_state: bool,
) -> tuple[int, ...] | None:
    """Each head's decay horizon (`decay_horizons`), capped at the call's length, where a
    dense call may read and write its state at the edges only (`_with_state_edges`): a fixed
    decay, some head's powers all 0 within the call, a state to read or write, outside
    torch.compile; else None. A head whose horizon reaches past the call (alibi_slow's last
    one) reads and writes with every token, the others with the first and last W tokens only,
    W the largest horizon within the call.
    A chunked call computes every chunk's state anyway: with its calls given the edges too,
    the tiny preset's streamed step at block 512 ran 0.93x as fast (the first run of
    `bench_state_edges.py`, docs/benchmarks.md)."""
    if log_decay is None or log_decay.requires_grad or executor != "dense":
        return None
    if (initial_state is None and not output_final_state) or torch.compiler.is_compiling():
        return None
    seq_len = q.shape[2]
    horizons = tuple(
        seq_len if w is None else min(w, seq_len) for w in decay_horizons(log_decay, q.dtype)
    )
    return horizons if min(horizons) < seq_len else None


def _with_state_edges(
    fn: Executor,
    q: Tensor,
    v: Tensor,
    initial_state: Tensor | None,
    log_decay: Tensor,
    chunk_size: int,
    output_final_state: bool,
    reset_mask: Tensor | None,
    horizons: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fn` over the call's own tokens (no incoming state, no final state), then the state
    terms at the call's edges (model/state_edges.py): `decay_powers` weighs every other read,
    every other write and the carried d^T rho0 of a head by exactly 0 past its horizon
    (`horizons`), so the whole call adds nothing more; skipping them saves N D multiply-adds a
    token and head for the read and N D for the write on all but the largest horizon within
    the call of its tokens, in the heads whose horizon falls within the call."""
    out, _ = fn(
        q,
        v,
        initial_state=None,
        log_decay=log_decay,
        chunk_size=chunk_size,
        output_final_state=False,
        reset_mask=reset_mask,
    )
    segment = None if reset_mask is None else reset_segments(reset_mask.to(q.device))
    final = output_final_state
    return state_edges(out, q, v, initial_state, log_decay, segment, horizons, final)
