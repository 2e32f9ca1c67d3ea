"""Every executor of the mixer against its definition, written out as plain sums.

For queries q [B,H,T,N], values v [B,1,T,D], an incoming state rho0 [B,H,N,D] and per-head
decay d = exp(log_decay) (d = 1 without decay):

    out_t = d^t q_t.rho0 + sum_{s<t} d^(t-s) (q_t.q_s) v_s      (read before write: s < t)
    rho_T = d^T rho0 + sum_s d^(T-s) q_s^T v_s

Outputs, final states and the gradients of q, v and rho0 under random upstream gradients on
both outputs must agree with the definition, in float64 to 1e-10 and in float32 to 1e-5.
Rope is applied to q before the mixer, so a "rope" model is the no-decay case with arbitrary
q; an "alibi" model is the negative per-head log-decay case.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import IN_PLACE_PRODUCTS, assert_close
from torch import Tensor

from bdh_train.model import mixer, positions
from bdh_train.model.matmul import is_heads_major
from bdh_train.model.mixer import (
    EXECUTOR_FUNCTIONS,
    EXECUTORS,
    choose_executor,
    dense_attention,
    linear_attention,
)

B, H, N, D = 2, 3, 5, 4
LOG_DECAY = torch.tensor([-1.0, -0.3, -0.05], dtype=torch.float64)  # alibi-like, per head
LENGTHS = [1, 5, 8, 13]
CHUNK_SIZES = [1, 3, 4, 16]
# (executor, chunk_size): chunked at every chunk size; dense and recurrent ignore it.
VARIANTS = [
    (name, c)
    for name in EXECUTORS
    for c in (CHUNK_SIZES if name == "chunked" else CHUNK_SIZES[-1:])
]


def definition(q, v, rho0, log_decay):
    """out and rho_T by the formulas above, token by token, in q's dtype."""
    batch, heads, seq_len, n = q.shape
    if rho0 is None:
        rho0 = q.new_zeros(batch, heads, n, v.shape[-1])
    d = q.new_ones(heads) if log_decay is None else log_decay.exp().to(q.dtype)
    d_out = d.view(1, heads, 1)  # against [B, H, D]
    d_state = d.view(1, heads, 1, 1)  # against [B, H, N, D]
    outs = []
    for t in range(seq_len):
        q_t = q[:, :, t]  # [B, H, N]
        out_t = d_out**t * torch.einsum("bhn,bhnd->bhd", q_t, rho0)
        for s in range(t):
            score = (q_t * q[:, :, s]).sum(-1, keepdim=True)  # [B, H, 1]
            out_t = out_t + d_out ** (t - s) * score * v[:, :, s]
        outs.append(out_t)
    rho = d_state**seq_len * rho0
    for s in range(seq_len):
        outer = q[:, :, s].unsqueeze(-1) * v[:, :, s].unsqueeze(-2)  # q_s^T v_s, [B, H, N, D]
        rho = rho + d_state ** (seq_len - s) * outer
    return torch.stack(outs, dim=2), rho


def make_inputs(seq_len, dtype, with_state, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, seq_len, N, generator=g, dtype=torch.float64)
    v = torch.randn(B, 1, seq_len, D, generator=g, dtype=torch.float64)
    rho0 = torch.randn(B, H, N, D, generator=g, dtype=torch.float64) if with_state else None
    upstream_out = torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64)
    upstream_rho = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    inputs = [x.to(dtype).requires_grad_() for x in (q, v, rho0) if x is not None]
    return inputs, (upstream_out.to(dtype), upstream_rho.to(dtype))


def outputs_and_grads(fn, inputs, upstream):
    """fn(q, v, rho0) -> (out, rho); returns out, rho and d(<out,g_out> + <rho,g_rho>)/d inputs."""
    q, v, *rest = inputs
    out, rho = fn(q, v, rest[0] if rest else None)
    loss = (out * upstream[0]).sum() + (rho * upstream[1]).sum()
    grads = torch.autograd.grad(loss, inputs)
    return out.detach(), rho.detach(), grads


def check_against_definition(executor, chunk_size, seq_len, decay, with_state, dtype, rtol):
    log_decay = LOG_DECAY if decay else None
    inputs, upstream = make_inputs(seq_len, dtype, with_state, seed=100 * seq_len + chunk_size)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref = outputs_and_grads(
        lambda q, v, r: definition(q, v, r, log_decay),
        ref_inputs,
        tuple(u.double() for u in upstream),
    )
    fn = EXECUTOR_FUNCTIONS[executor]
    got = outputs_and_grads(
        lambda q, v, r: fn(q, v, initial_state=r, log_decay=log_decay, chunk_size=chunk_size),
        inputs,
        upstream,
    )
    what = f"{executor} C={chunk_size} T={seq_len} decay={decay} state={with_state} {dtype}"
    assert got[0].dtype == dtype and got[1].dtype == dtype, what
    assert_close(got[0], ref[0], rtol=rtol, msg=f"{what}: out")
    assert_close(got[1], ref[1], rtol=rtol, msg=f"{what}: final state")
    for name, g, g_ref in zip(("q", "v", "rho0"), got[2], ref[2], strict=False):
        assert_close(g, g_ref, rtol=rtol, msg=f"{what}: grad of {name}")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "carried-state"])
@pytest.mark.parametrize("decay", [False, True], ids=["rope", "alibi"])
@pytest.mark.parametrize("seq_len", LENGTHS)
@pytest.mark.parametrize(("executor", "chunk_size"), VARIANTS)
def test_executor_matches_definition_fp64(executor, chunk_size, seq_len, decay, with_state):
    check_against_definition(
        executor, chunk_size, seq_len, decay, with_state, torch.float64, rtol=1e-10
    )


@pytest.mark.parametrize(("executor", "chunk_size"), VARIANTS)
def test_executor_matches_definition_fp32(executor, chunk_size):
    check_against_definition(
        executor, chunk_size, 13, decay=True, with_state=True, dtype=torch.float32, rtol=1e-5
    )


@pytest.mark.parametrize(("executor", "chunk_size"), [("dense", 0), ("chunked", 16)])
def test_long_decay_drops_only_negligible_powers(executor, chunk_size):
    """T=70 under alibi's strongest decay (d = e^-1 on head 0): powers from e^-44 on are 0 in
    float32 (`decay_powers`), in the score blocks, the writes, the carries and rho0's part;
    outputs, final state and gradients still match the definition's exact powers (1e-5)."""
    check_against_definition(
        executor, chunk_size, 70, decay=True, with_state=True, dtype=torch.float32, rtol=1e-5
    )


def test_the_definition_is_the_state_recurrence():
    """The formulas equal the read-then-write loop rho <- d (rho + q_t^T v_t) they come from."""
    (q, v, rho0), _ = make_inputs(5, torch.float64, True, seed=7)
    out, rho = definition(q, v, rho0, LOG_DECAY)
    d = LOG_DECAY.exp().view(1, H, 1, 1)
    state = rho0
    for t in range(5):
        assert_close(out[:, :, t], torch.einsum("bhn,bhnd->bhd", q[:, :, t], state), rtol=1e-12)
        state = d * (state + q[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2))
    assert_close(rho, state, rtol=1e-12)


@pytest.mark.parametrize("decay", [False, True], ids=["rope", "alibi"])
@pytest.mark.parametrize(("executor", "chunk_size"), VARIANTS)
def test_without_final_state_the_output_is_unchanged(executor, chunk_size, decay):
    """output_final_state=False: same out; dense and chunked skip the state (None)."""
    (q, v, rho0), _ = make_inputs(8, torch.float64, True, seed=3)
    kwargs = dict(initial_state=rho0, log_decay=LOG_DECAY if decay else None, chunk_size=chunk_size)
    fn = EXECUTOR_FUNCTIONS[executor]
    out, rho = fn(q, v, **kwargs)
    out_only, no_rho = fn(q, v, output_final_state=False, **kwargs)
    assert torch.equal(out_only, out)
    if executor == "recurrent":
        assert torch.equal(no_rho, rho)  # its state is the loop's carry: always returned
    else:
        assert no_rho is None


@pytest.mark.parametrize("executor", ["auto", *EXECUTORS])
def test_linear_attention_dispatches_by_name(executor):
    (q, v, rho0), _ = make_inputs(8, torch.float64, True, seed=5)
    kwargs = dict(initial_state=rho0, log_decay=LOG_DECAY, chunk_size=3)
    got = linear_attention(q, v, executor=executor, **kwargs)
    name = "dense" if executor == "auto" else executor  # T=8, N=5, D=4: dense is cheaper
    expected = EXECUTOR_FUNCTIONS[name](q, v, **kwargs)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# Row 0: documents start at 3, 4 (a one-token document) and 9, and the row continues rho0
# until 3; row 1 drops rho0 at once and starts its last document at the final token. With
# chunk size 3 the starts 3 and 9 fall on a chunk's first token, 4 inside a chunk; with 4
# it is the other way round.
RESET_AT = ({3, 4, 9}, {0, 12})


def reset_mask_for(seq_len: int) -> torch.Tensor:
    mask = torch.zeros(B, seq_len, dtype=torch.bool)
    for row, starts in enumerate(RESET_AT):
        mask[row, [t for t in starts if t < seq_len]] = True
    return mask


def definition_with_resets(q, v, rho0, log_decay, mask):
    """Each document of each row by `definition` on its own: the first from rho0 (unless the
    row resets at token 0), the others from a zero state; the final state is the last one's."""
    outs, finals = [], []
    for row in range(q.shape[0]):
        bounds = [0, *[t for t in range(1, q.shape[2]) if mask[row, t]], q.shape[2]]
        pieces = []
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            carried = i == 0 and rho0 is not None and not mask[row, 0]
            out, final = definition(
                q[row : row + 1, :, start:end],
                v[row : row + 1, :, start:end],
                rho0[row : row + 1] if carried else None,
                log_decay,
            )
            pieces.append(out)
        outs.append(torch.cat(pieces, dim=2))
        finals.append(final)
    return torch.cat(outs), torch.cat(finals)


RESET_VARIANTS = [("dense", 16), ("chunked", 3), ("chunked", 4), ("recurrent", 16)]


@pytest.mark.parametrize(
    ("executor", "chunk_size", "decay", "dtype"),
    [
        *(
            pytest.param(e, c, decay, torch.float64, id=f"{e}-{c}-{'alibi' if decay else 'rope'}")
            for e, c in RESET_VARIANTS
            for decay in (False, True)
        ),
        pytest.param("chunked", 3, True, torch.float32, id="chunked-3-alibi-fp32"),
        pytest.param("chunked", 3, False, torch.float32, id="chunked-3-rope-fp32"),
        pytest.param("dense", 16, False, torch.float32, id="dense-16-rope-fp32"),
    ],
)
def test_executor_with_document_resets_matches_separate_documents(
    executor, chunk_size, decay, dtype
):
    """A reset drops rho0 and every earlier token: outputs, final state and gradients equal
    those of running each document from its own fresh state (fp64 1e-10, fp32 1e-5)."""
    seq_len, log_decay = 13, LOG_DECAY if decay else None
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    mask = reset_mask_for(seq_len)
    inputs, upstream = make_inputs(seq_len, dtype, True, seed=7 + chunk_size)
    ref = outputs_and_grads(
        lambda q, v, r: definition_with_resets(q, v, r, log_decay, mask),
        [x.detach().double().requires_grad_() for x in inputs],
        tuple(u.double() for u in upstream),
    )
    fn = EXECUTOR_FUNCTIONS[executor]
    got = outputs_and_grads(
        lambda q, v, r: fn(
            q, v, initial_state=r, log_decay=log_decay, chunk_size=chunk_size, reset_mask=mask
        ),
        inputs,
        upstream,
    )
    what = f"{executor} C={chunk_size} decay={decay} {dtype}"
    assert_close(got[0], ref[0], rtol=rtol, msg=f"{what}: out")
    assert_close(got[1], ref[1], rtol=rtol, msg=f"{what}: final state")
    for name, g, g_ref in zip(("q", "v", "rho0"), got[2], ref[2], strict=True):
        assert_close(g, g_ref, rtol=rtol, msg=f"{what}: grad of {name}")


@pytest.mark.parametrize("decay", [False, True], ids=["rope", "alibi"])
@pytest.mark.parametrize("need_state", [True, False])
def test_chunked_with_resets_equals_dense_over_several_chunks(need_state, decay):
    """Resets inside the call: T = 7 in chunks of 3 (the last of one token), a reset in each
    row, with and without the final state (every chunk but the last must still pass its state
    on), against dense, fp64 1e-10: all chunks at once through the reset masks of the
    hand-written Function (times the decay's powers with decay)."""
    inputs, _ = make_inputs(7, torch.float64, True, seed=5)
    q, v, rho0 = (x.detach() for x in inputs)
    mask = torch.zeros(B, 7, dtype=torch.bool)
    mask[0, 4] = mask[1, 2] = True
    kwargs = dict(
        initial_state=rho0,
        log_decay=LOG_DECAY if decay else None,
        output_final_state=need_state,
        reset_mask=mask,
    )
    ref = mixer.dense_attention(q, v, **kwargs)
    got = mixer.chunked_attention(q, v, chunk_size=3, **kwargs)
    assert_close(got[0], ref[0], rtol=1e-10, msg="out")
    if need_state:
        assert_close(got[1], ref[1], rtol=1e-10, msg="final state")
    else:
        assert got[1] is None


def test_an_all_false_reset_mask_changes_nothing():
    """Bit for bit where the mask only adds masking; under decay the Function weighs its
    terms by the decay's powers times the all-ones masks, a product the call without a mask
    does not take: the two agree to fp64 1e-12."""
    inputs, _ = make_inputs(8, torch.float64, True, seed=3)
    q, v, rho0 = (x.detach() for x in inputs)
    for name, fn in EXECUTOR_FUNCTIONS.items():
        plain = fn(q, v, initial_state=rho0, log_decay=LOG_DECAY, chunk_size=3)
        masked = fn(
            q,
            v,
            initial_state=rho0,
            log_decay=LOG_DECAY,
            chunk_size=3,
            reset_mask=torch.zeros(B, 8, dtype=torch.bool),
        )
        if name in ("chunked", "dense"):
            assert_close(masked[0], plain[0], rtol=1e-12, msg="out")
            assert_close(masked[1], plain[1], rtol=1e-12, msg="final state")
        else:
            assert torch.equal(plain[0], masked[0]) and torch.equal(plain[1], masked[1])


# choose_executor at its exact thresholds. With N = 2, D = 1, C = 2: dense costs 3 T
# multiply-adds per token and head, chunked 2 * 3 + 2 * 2 * 1 = 10, and chunked needs
# 1.5 * 10 = 15 < 3 T: T = 5 is the tie (dense), T = 6 the first length where chunked wins.
@pytest.mark.parametrize(
    ("seq_len", "n_neurons", "n_embd", "chunk_size", "expected"),
    [
        (1, 2, 1, 2, "dense"),  # shorter than one chunk
        (2, 2, 1, 2, "dense"),  # exactly one chunk
        (5, 2, 1, 2, "dense"),  # 1.5 * 10 = 15 = 3 * 5: a tie is not a win
        (6, 2, 1, 2, "chunked"),  # 15 < 18
        (100, 2, 1, 2, "chunked"),
        # N = 8, D = 4, C = 4: chunked 4 * 12 + 2 * 32 = 112, 1.5 * 112 = 168 = 12 * 14.
        (14, 8, 4, 4, "dense"),
        (15, 8, 4, 4, "chunked"),
        # The state term dominates: 1.5 * (1 * 101 + 2 * 100) = 451.5 < 101 T from T = 5.
        (4, 100, 1, 1, "dense"),
        (5, 100, 1, 1, "chunked"),
    ],
)
def test_choose_executor_thresholds(seq_len, n_neurons, n_embd, chunk_size, expected):
    assert choose_executor(seq_len, n_neurons, n_embd, chunk_size) == expected


# Dense in row panels of P = 2 covers (T + 2) / 2 keys per query for an even T: with N = 2,
# D = 1, C = 2 it costs 3 (T + 2) / 2 against chunked's 1.5 * 10 = 15, a tie at T = 8; at
# T = 9 the panels cover 2*2 + 2*4 + 2*6 + 2*8 + 1*9 = 49 pairs, 3 * 49 / 9 > 15.
@pytest.mark.parametrize(
    ("seq_len", "expected"), [(6, "dense"), (8, "dense"), (9, "chunked"), (100, "chunked")]
)
def test_choose_executor_counts_dense_in_row_panels(seq_len, expected):
    assert choose_executor(seq_len, 2, 1, 2, 1.5, dense_panel_rows=2) == expected


def test_dense_keys_per_query_counts_the_panels_pairs():
    assert mixer.dense_keys_per_query(8, 2) == (8 + 2) / 2
    assert mixer.dense_keys_per_query(9, 2) == 49 / 9  # a last panel of one row
    assert mixer.dense_keys_per_query(9, 0) == 9  # no panels: every key
    assert mixer.dense_keys_per_query(2, 4) == 2  # one panel: the whole call


def test_linear_attention_passes_every_argument_to_the_named_executor(monkeypatch):
    """Dispatch by name ('auto' through choose_executor on T, N, D and chunk_size), every
    keyword passed through unchanged, the executor's result returned as it is."""
    calls = []

    def spy(name):
        def executor(q, v, **kwargs):
            calls.append((name, q, v, kwargs))
            return name, kwargs

        return executor

    monkeypatch.setattr(mixer, "EXECUTOR_FUNCTIONS", {name: spy(name) for name in EXECUTORS})
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", mixer.ExecutorCalibration(128, 1.5))
    # T = 6, N = 2, D = 1, C = 2: chunked (test_choose_executor_thresholds); T = 5: dense.
    q, v = torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 1)
    state, log_decay, mask = torch.ones(1, 1, 2, 1), torch.zeros(1), torch.ones(1, 6).bool()
    kwargs = dict(
        initial_state=state,
        log_decay=log_decay,
        chunk_size=2,
        output_final_state=False,
        reset_mask=mask,
    )
    for executor, expected in [
        ("auto", "chunked"),
        ("dense", "dense"),
        ("chunked", "chunked"),
        ("recurrent", "recurrent"),
    ]:
        calls.clear()
        result = linear_attention(q, v, executor=executor, **kwargs)
        assert result == (expected, kwargs)
        assert len(calls) == 1 and calls[0][0] == expected
        assert calls[0][1] is q and calls[0][2] is v and calls[0][3] == kwargs
        for key in ("initial_state", "log_decay", "reset_mask"):
            assert calls[0][3][key] is kwargs[key]
    q5, v5 = q[:, :, :5], v[:, :, :5]
    assert linear_attention(q5, v5, executor="auto", chunk_size=2)[0] == "dense"
    # The defaults: no state, no decay, the CPU's calibrated chunk (128 here), the final
    # state, no resets.
    calls.clear()
    linear_attention(q5, v5, executor="dense")
    assert calls[0][3] == dict(
        initial_state=None,
        log_decay=None,
        chunk_size=128,
        output_final_state=True,
        reset_mask=None,
    )


def test_a_zero_chunk_size_takes_the_device_calibration(monkeypatch):
    """chunk_size 0 runs with the calibrated chunk of q's device type, and 'auto' weighs the
    two executors with that device's margin."""
    chosen = []

    def record(name):
        return lambda q, v, **kwargs: chosen.append((name, kwargs["chunk_size"]))

    monkeypatch.setattr(mixer, "EXECUTOR_FUNCTIONS", {name: record(name) for name in EXECUTORS})
    # N = 8, D = 4: dense costs 12 T; chunked with C = 4 costs 112 (thresholds test above).
    q, v = torch.zeros(1, 1, 14, 8), torch.zeros(1, 1, 14, 4)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", mixer.ExecutorCalibration(4, 1.5))
    linear_attention(q, v, executor="auto", chunk_size=0)  # 1.5 * 112 = 168 = 12 * 14
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", mixer.ExecutorCalibration(4, 1.4))
    linear_attention(q, v, executor="auto", chunk_size=0)  # 1.4 * 112 < 168
    linear_attention(q, v, executor="chunked", chunk_size=3)
    assert chosen == [("dense", 4), ("chunked", 4), ("chunked", 3)]
    assert mixer.calibration_for("mps") == mixer.UNMEASURED_DEVICE


@pytest.mark.parametrize(
    ("device_type", "seq_len", "n_neurons", "n_embd", "fastest"),
    [
        # The executor that measured fastest (docs/benchmarks.md: bench_calibration.py, and the
        # CUDA calibration tables under gpu.sh).
        ("cpu", 256, 512, 128, "dense"),
        ("cpu", 512, 512, 128, "dense"),
        ("cpu", 768, 512, 128, "chunked"),
        ("cpu", 1024, 512, 128, "chunked"),
        ("cpu", 512, 2048, 256, "dense"),
        ("cpu", 1024, 2048, 256, "dense"),
        ("cpu", 1536, 2048, 256, "chunked"),
        ("cpu", 2048, 2048, 256, "chunked"),
        ("cpu", 256, 2048, 256, "dense"),
        ("cuda", 512, 512, 128, "dense"),
        ("cuda", 2048, 512, 128, "chunked"),
        ("cuda", 8192, 512, 128, "chunked"),
        ("cuda", 512, 2048, 256, "dense"),
        ("cuda", 2048, 2048, 256, "chunked"),
        ("cuda/bfloat16", 512, 512, 128, "dense"),
        ("cuda/bfloat16", 8192, 512, 128, "chunked"),
        ("cuda/bfloat16", 512, 2048, 256, "dense"),
        ("cuda/bfloat16", 2048, 2048, 256, "dense"),
        ("cuda/bfloat16", 8192, 2048, 256, "chunked"),
    ],
)
def test_auto_picks_the_executor_measured_fastest(device_type, seq_len, n_neurons, n_embd, fastest):
    device_type, _, dtype = device_type.partition("/")
    dtype = getattr(torch, dtype) if dtype else None
    executor, chunk = mixer.resolve_executor(
        "auto", seq_len, n_neurons, n_embd, 0, device_type, dtype
    )
    assert (executor, chunk) == (fastest, 128)


def test_autocast_chooses_with_its_dtypes_calibration(monkeypatch):
    """Under autocast the products run in autocast's dtype, whatever the queries' dtype is
    (rope turns bf16 queries back into float32): the executor follows that dtype's
    calibration."""
    chosen = []

    def record(name):
        return lambda q, v, **kwargs: chosen.append(name)

    monkeypatch.setattr(mixer, "EXECUTOR_FUNCTIONS", {name: record(name) for name in EXECUTORS})
    # N = 8, D = 4, C = 4: dense costs 12 T = 168 at T = 14; chunked 112 (x1.4 < 168 < x2)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", mixer.ExecutorCalibration(4, 1.4))
    monkeypatch.setitem(
        mixer.EXECUTOR_CALIBRATION, "cpu/bfloat16", mixer.ExecutorCalibration(4, 2.0)
    )
    q, v = torch.zeros(1, 1, 14, 8), torch.zeros(1, 1, 14, 4)
    linear_attention(q, v, executor="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_attention(q, v, executor="auto")
    linear_attention(q.bfloat16(), v.bfloat16(), executor="auto")
    assert chosen == ["chunked", "dense", "dense"]


def test_linear_attention_rejects_an_unknown_executor():
    q, v = torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 1)
    message = (
        "unknown executor 'flash'; expected one of ('dense', 'chunked', 'recurrent') or 'auto'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        linear_attention(q, v, executor="flash")


@pytest.mark.parametrize(("executor", "chunk_size"), [("dense", 16), ("chunked", 4)])
def test_float32_log_decay_is_raised_to_its_powers_in_float64(executor, chunk_size):
    """A float32 log-decay (a learned one kept in float32) with float64 activations: d^e is
    exp(log d * e) in float64, so dense and chunked match the float64 definition to 1e-10
    (powers taken in float32 are off by about 1e-7). The recurrent executor takes exp of the
    float32 log-decay and is not held to this."""
    inputs, _ = make_inputs(13, torch.float64, True, seed=11)
    q, v, rho0 = (x.detach() for x in inputs)
    log_decay = LOG_DECAY.float()
    expected = definition(q, v, rho0, log_decay.double())
    got = EXECUTOR_FUNCTIONS[executor](
        q, v, initial_state=rho0, log_decay=log_decay, chunk_size=chunk_size
    )
    assert_close(got[0], expected[0], rtol=1e-10, msg="out")
    assert_close(got[1], expected[1], rtol=1e-10, msg="final state")


def test_a_device_type_without_autocast_still_runs():
    """'meta' has no autocast: asking whether autocast is on there raises, so the executor
    choice must not ask (shape-only tracing on meta tensors keeps working)."""
    q, v = torch.zeros(1, 1, 4, 8, device="meta"), torch.zeros(1, 1, 4, 4, device="meta")
    out, _ = linear_attention(q, v, executor="auto")
    assert out.shape == (1, 1, 4, 4) and out.device.type == "meta"


# ------------------------------------------- the chunked executor's hand-written backward
def products_and_function(
    seq_len, chunk_size, dtype, with_state, value_heads, final_state, log_decay=None
):
    """Outputs and gradients of `chunked_attention` (its autograd Function) and of
    `chunked_by_products` (the same products under autograd), on the same inputs."""
    inputs, (g_out, g_rho) = make_inputs(seq_len, dtype, with_state, seed=31 * seq_len)
    q, v, *rest = inputs
    if value_heads > 1:  # a value per head
        v = v.detach().expand(B, value_heads, seq_len, D).contiguous().requires_grad_()
    leaves = [q, v, *rest]
    rho0 = rest[0] if rest else None

    def run(fn):
        out, final = fn(q, v, rho0)
        loss = (out * g_out).sum() + ((final * g_rho).sum() if final_state else 0)
        return out.detach(), final, torch.autograd.grad(loss, leaves), out.grad_fn

    executor = mixer.chunked_attention
    if chunk_size is None:  # dense: the Function with one chunk of the whole call
        executor, chunk_size = mixer.dense_attention, seq_len
    got = run(
        lambda q, v, r: executor(
            q,
            v,
            initial_state=r,
            chunk_size=chunk_size,
            output_final_state=final_state,
            log_decay=log_decay,
        )
    )
    expected = run(
        lambda q, v, r: mixer.chunked_by_products(q, v, r, log_decay, chunk_size, final_state)
    )
    return got, expected


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
@pytest.mark.parametrize("final_state", [True, False], ids=["final-state", "out-only"])
@pytest.mark.parametrize("value_heads", [1, H], ids=["shared-v", "per-head-v"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "carried-state"])
@pytest.mark.parametrize(
    ("seq_len", "chunk_size"),
    [(13, 4), (12, 4), (5, 16), (8, 1), (9, None)],
    ids=["padded", "whole-chunks", "one-padded-chunk", "one-token-chunks", "dense"],
)
def test_chunked_function_equals_autograd_of_its_products(
    seq_len, chunk_size, with_state, value_heads, final_state, decay
):
    """The Function's outputs and its backward's gradients (q, v, rho0) against autograd
    through `chunked_by_products` (chunk size None: the dense executor, which is the Function
    with one chunk, against one chunk's products), in float64 to 1e-10 and float32 to 1e-5,
    with a shared or per-head value, with and without the final state (whose gradient then
    does not exist), without decay and with alibi-like per-head decays."""
    log_decay = LOG_DECAY if decay else None
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        got, expected = products_and_function(
            seq_len, chunk_size, dtype, with_state, value_heads, final_state, log_decay
        )
        what = f"T={seq_len} C={chunk_size} state={with_state} Hv={value_heads} {dtype} {decay=}"
        assert type(got[3]).__name__ == "ChunkedAttentionBackward", what  # the fast path ran
        assert type(expected[3]).__name__ != "ChunkedAttentionBackward", what
        assert_close(got[0], expected[0], rtol=rtol, msg=f"{what}: out")
        assert (got[1] is None) == (not final_state), what
        if final_state:
            assert_close(got[1].detach(), expected[1].detach(), rtol=rtol, msg=f"{what}: state")
        for name, g, g_ref in zip(("q", "v", "rho0"), got[2], expected[2], strict=False):
            assert g.shape == g_ref.shape, f"{what}: grad of {name}"
            assert_close(g, g_ref, rtol=rtol, msg=f"{what}: grad of {name}")


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
def test_chunked_function_passes_gradcheck(decay):
    """Finite differences against the hand-written backward, every input and both outputs,
    with and without decay (T=7 in chunks of 3: the last chunk padded)."""
    from bdh_train.model.chunked_grad import ChunkedAttention

    (q, v, rho0), _ = make_inputs(7, torch.float64, True, seed=11)
    log_decay = LOG_DECAY if decay else None
    assert torch.autograd.gradcheck(
        lambda q, v, r: ChunkedAttention.apply(q, v, r, 3, True, None, False, log_decay, 0),
        (q, v, rho0),
    )
    # heads first ([H, B, ...], the layout heads-major queries run in), and no rho0
    q_first = q.detach().transpose(0, 1).contiguous().requires_grad_()
    v_first = v.detach().transpose(0, 1).contiguous().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, v: ChunkedAttention.apply(q, v, None, 3, True, None, True, log_decay, 0),
        (q_first, v_first),
    )


@pytest.mark.parametrize("executor", ["dense", "chunked"])
def test_the_autograd_form_runs_under_decay_and_autocast(executor):
    """A learned decay (its gradient) and autocast keep the products autograd differentiates;
    resets, a fixed decay and both together run through the Function."""
    (q, v, rho0), _ = make_inputs(8, torch.float32, True, seed=2)
    fn = EXECUTOR_FUNCTIONS[executor]
    mask = torch.zeros(B, 8, dtype=torch.bool)
    mask[0, 5] = True
    learned = LOG_DECAY.clone().requires_grad_()
    for kwargs in (dict(log_decay=learned), dict(log_decay=learned, reset_mask=mask)):
        out, _ = fn(q, v, initial_state=rho0, chunk_size=3, **kwargs)
        assert type(out.grad_fn).__name__ != "ChunkedAttentionBackward", kwargs
    for kwargs in (
        dict(reset_mask=mask),
        dict(log_decay=LOG_DECAY),
        dict(log_decay=LOG_DECAY, reset_mask=mask),
    ):
        out, _ = fn(q, v, initial_state=rho0, chunk_size=3, **kwargs)
        assert type(out.grad_fn).__name__ == "ChunkedAttentionBackward", kwargs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fn(q, v, initial_state=rho0, chunk_size=3)
    assert type(out.grad_fn).__name__ != "ChunkedAttentionBackward"


@pytest.mark.parametrize("final_state", [True, False], ids=["final-state", "out-only"])
@pytest.mark.parametrize(
    ("executor", "chunk_size"), [("dense", 16), ("chunked", 3), ("chunked", 4)]
)
def test_without_gradients_the_executors_compute_the_same(executor, chunk_size, final_state):
    """Without a gradient to record the Function's forward runs alone (nothing saved): the
    same outputs, bit for bit, as the recorded call (T=8: chunk 3 pads, 4 does not)."""
    (q, v, rho0), _ = make_inputs(8, torch.float64, True, seed=4)
    fn = EXECUTOR_FUNCTIONS[executor]
    kwargs = dict(initial_state=rho0, chunk_size=chunk_size, output_final_state=final_state)
    recorded = fn(q, v, **kwargs)
    assert type(recorded[0].grad_fn).__name__ == "ChunkedAttentionBackward"
    with torch.no_grad():
        plain = fn(q, v, **kwargs)
    assert plain[0].grad_fn is None and plain[0].shape == recorded[0].shape
    assert torch.equal(plain[0], recorded[0])
    if final_state:
        assert torch.equal(plain[1], recorded[1])
    else:
        assert plain[1] is None and recorded[1] is None


@pytest.mark.parametrize("alone", ["q", "v", "rho0"])
@pytest.mark.parametrize(("executor", "chunk_size"), [("dense", 16), ("chunked", 3)])
def test_one_input_alone_gets_its_gradient(executor, chunk_size, alone):
    """One of queries, values and the incoming state taking a gradient, the other two data
    (the incoming state alone: a TBPTT chunk whose inputs are data): the Function still
    records, and that input's gradient is the definition's."""
    (q, v, rho0), (g_out, g_rho) = make_inputs(8, torch.float64, True, seed=6)
    named = {"q": q, "v": v, "rho0": rho0}
    q, v, rho0 = (x if name == alone else x.detach() for name, x in named.items())
    leaf = named[alone]
    out, final = EXECUTOR_FUNCTIONS[executor](q, v, initial_state=rho0, chunk_size=chunk_size)
    assert type(out.grad_fn).__name__ == "ChunkedAttentionBackward"
    (got,) = torch.autograd.grad((out * g_out).sum() + (final * g_rho).sum(), leaf)
    ref_out, ref_final = definition(q, v, rho0, None)
    (expected,) = torch.autograd.grad((ref_out * g_out).sum() + (ref_final * g_rho).sum(), leaf)
    assert_close(got, expected, rtol=1e-10)


def test_dense_without_a_state_computes_only_the_score_products():
    """Dense with no incoming state and no final state: forward Q Q^T and A V, backward
    dOut V^T, (dA + dA^T) Q and A^T dOut; no state read, no write (counted by torch)."""
    from torch.utils.flop_counter import FlopCounterMode

    (q, v), (g_out, _) = make_inputs(8, torch.float64, False, seed=8)
    with FlopCounterMode(display=False) as counter:
        out, _ = mixer.dense_attention(q, v, output_final_state=False)
        out.backward(g_out)
    seq_len = 8
    assert counter.get_total_flops() == 2 * B * H * seq_len * seq_len * (2 * N + 3 * D)


@pytest.mark.parametrize("heads_major", [False, True], ids=["contiguous", "heads-major"])
@pytest.mark.parametrize("final_state", [True, False], ids=["final-state", "out-only"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "carried-state"])
@pytest.mark.parametrize(
    ("seq_len", "panel_rows"),
    [(13, 4), (12, 4), (13, 1), (8, 7), (8, 8), (5, 16)],
    ids=[
        "last-panel-short",
        "whole-panels",
        "one-row-panels",
        "two-panels",
        "one-panel",
        "panel-longer-than-call",
    ],
)
def test_dense_in_row_panels_matches_the_definition(
    monkeypatch, seq_len, panel_rows, with_state, final_state, heads_major
):
    """Dense with the device's panel rows set small: outputs, final state and the gradients
    of q, v and rho0 against the definition, float64 to 1e-10 and float32 to 1e-5; the
    panels run only when the call is longer than one panel. Deterministic mode fills every
    uninitialized tensor with NaN, so a buffer element left unwritten shows."""
    calibration = mixer.ExecutorCalibration(128, 1.5, dense_panel_rows=panel_rows)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", calibration)
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check_panels_against_definition(seq_len, panel_rows, with_state, final_state, heads_major)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


def check_panels_against_definition(seq_len, panel_rows, with_state, final_state, heads_major):
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        inputs, (g_out, g_rho) = make_inputs(seq_len, dtype, with_state, seed=7 * seq_len)
        ref_inputs = [x.detach().double().requires_grad_() for x in inputs]

        def loss(out, final, g_out=g_out, g_rho=g_rho):
            total = (out * g_out.to(out.dtype)).sum()
            return total + (final * g_rho.to(out.dtype)).sum() if final_state else total

        q, v, *rest = inputs
        q_in = q.transpose(0, 1).contiguous().transpose(0, 1) if heads_major else q
        assert is_heads_major(q_in) == heads_major
        out, final = mixer.dense_attention(
            q_in, v, initial_state=rest[0] if rest else None, output_final_state=final_state
        )
        r_q, r_v, *r_rest = ref_inputs
        r_out, r_final = definition(r_q, r_v, r_rest[0] if r_rest else None, None)
        what = f"T={seq_len} P={panel_rows} state={with_state} {final_state=} {dtype}"
        node = out.grad_fn.next_functions[0][0] if heads_major else out.grad_fn
        assert node.in_panels == (panel_rows < seq_len), what
        assert_close(out.detach().double(), r_out.detach(), rtol=rtol, msg=f"{what}: out")
        if final_state:
            assert_close(final.detach().double(), r_final.detach(), rtol=rtol, msg=f"{what}: state")
        else:
            assert final is None, what
        got = torch.autograd.grad(loss(out, final), inputs)
        expected = torch.autograd.grad(loss(r_out, r_final), ref_inputs)
        for name, g, g_ref in zip(("q", "v", "rho0"), got, expected, strict=False):
            assert_close(g.double(), g_ref, rtol=rtol, msg=f"{what}: grad of {name}")


@pytest.mark.parametrize("factors", ["resets", "decay", "both"])
def test_row_panels_run_without_resets_and_decay_only(monkeypatch, factors):
    """Resets and decay weigh the whole score matrix: given panel rows anyway, the Function
    computes it whole (and equals the definition, fp64 1e-10); the mixer gives dense no
    panels for such calls and counts none in 'auto' (at T = 30, N = 5, D = 4 and C = 16,
    dense with panels of 4 covers 508 / 30 keys a query: 152.4 < 1.15 * 184 = 211.6;
    without them 30 * 9 = 270 > 211.6)."""
    from bdh_train.model.chunked_grad import chunked_attention_function

    calibration = mixer.ExecutorCalibration(16, 1.15, dense_panel_rows=4)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", calibration)
    (q, v, rho0), _ = make_inputs(13, torch.float64, True, seed=13)
    mask = reset_mask_for(13) if factors in ("resets", "both") else None
    log_decay = LOG_DECAY if factors in ("decay", "both") else None
    out, final = chunked_attention_function(q, v, rho0, 13, True, mask, log_decay, 4)
    assert out.grad_fn.in_panels is False
    if mask is not None:
        expected = definition_with_resets(q, v, rho0, log_decay, mask)
    else:
        expected = definition(q, v, rho0, LOG_DECAY)
    assert_close(out, expected[0], rtol=1e-10)
    assert_close(final, expected[1], rtol=1e-10)
    assert mixer._dense_panel_rows(q, log_decay, mask) == 0
    assert mixer._dense_panel_rows(q, None, None) == 4
    long_q, long_v = torch.zeros(1, H, 30, N), torch.zeros(1, 1, 30, D)
    calls = []
    for name in EXECUTORS:
        monkeypatch.setitem(
            mixer.EXECUTOR_FUNCTIONS, name, lambda q, v, name=name, **kw: calls.append(name)
        )
    linear_attention(long_q, long_v, executor="auto")
    long_mask = torch.zeros(1, 30, dtype=torch.bool)
    linear_attention(long_q, long_v, executor="auto", reset_mask=long_mask)
    assert calls == ["dense", "chunked"]


def test_the_chunked_executor_never_runs_row_panels(monkeypatch):
    """One chunk of the chunked executor (C >= T) is the whole matrix: panels are dense's."""
    calibration = mixer.ExecutorCalibration(128, 1.5, dense_panel_rows=4)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", calibration)
    (q, v), _ = make_inputs(13, torch.float64, False, seed=14)
    out, _ = mixer.chunked_attention(q, v, chunk_size=16)
    assert out.grad_fn.in_panels is False
    assert mixer.dense_attention(q, v)[0].grad_fn.in_panels is True


@pytest.mark.parametrize("value_heads", [1, H], ids=["shared-v", "per-head-v"])
def test_row_panels_with_a_loss_on_the_final_state_alone(monkeypatch, value_heads):
    """Panels when only the final state takes a gradient (the output's is None in backward)
    and with a value per head: gradients equal the definition's (fp64, 1e-10)."""
    calibration = mixer.ExecutorCalibration(128, 1.5, dense_panel_rows=4)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", calibration)
    (q, v, rho0), (g_out, g_rho) = make_inputs(13, torch.float64, True, seed=15)
    if value_heads > 1:
        v = v.detach().expand(B, value_heads, 13, D).contiguous().requires_grad_()
    for weights in ((None, g_rho), (g_out, g_rho)):
        out, final = mixer.dense_attention(q, v, initial_state=rho0)
        assert out.grad_fn.in_panels
        ref_out, ref_final = definition(q, v, rho0, None)

        def loss(o, f, weights=weights):
            total = (f * weights[1]).sum()
            return total if weights[0] is None else total + (o * weights[0]).sum()

        got = torch.autograd.grad(loss(out, final), (q, v, rho0))
        expected = torch.autograd.grad(loss(ref_out, ref_final), (q, v, rho0))
        for g, g_ref in zip(got, expected, strict=True):
            assert_close(g, g_ref, rtol=1e-10)


def test_dense_in_row_panels_skips_the_blocks_above_the_diagonal(monkeypatch):
    """T = 8 in panels of 4 rows: forward covers 4*4 + 4*8 = 48 of the 64 (query, key)
    pairs for Q Q^T and A V, backward 48 for dOut V^T and A^T dOut and all 64 for
    (dA + dA^T) Q (counted by torch)."""
    from torch.utils.flop_counter import FlopCounterMode

    calibration = mixer.ExecutorCalibration(128, 1.5, dense_panel_rows=4)
    monkeypatch.setitem(mixer.EXECUTOR_CALIBRATION, "cpu", calibration)
    (q, v), (g_out, _) = make_inputs(8, torch.float64, False, seed=8)
    with FlopCounterMode(display=False, custom_mapping=IN_PLACE_PRODUCTS) as counter:
        out, _ = mixer.dense_attention(q, v, output_final_state=False)
        out.backward(g_out)
    assert counter.get_total_flops() == 2 * B * H * (48 * N + 48 * D + 48 * D + 64 * N + 48 * D)


def test_dense_in_row_panels_passes_gradcheck():
    """Finite differences against the panels' backward: T = 7 in panels of 3 (the last one
    row), with rho0 and both outputs."""
    from bdh_train.model.chunked_grad import ChunkedAttention

    (q, v, rho0), _ = make_inputs(7, torch.float64, True, seed=12)
    assert torch.autograd.gradcheck(
        lambda q, v, r: ChunkedAttention.apply(q, v, r, 7, True, None, False, None, 3),
        (q, v, rho0),
    )


def test_dense_over_no_tokens_returns_the_incoming_state():
    """A call of length 0 reads nothing and writes nothing: an empty output, and the incoming
    state as the final one (dense handles it through its autograd form)."""
    (q, v, rho0), _ = make_inputs(0, torch.float64, True, seed=9)
    out, final = mixer.dense_attention(q, v, initial_state=rho0)
    assert out.shape == (B, H, 0, D)
    assert torch.equal(final, rho0)


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
@pytest.mark.parametrize("chunk_size", [3, 4, 13])
def test_chunked_function_with_resets_passes_gradcheck(chunk_size, decay):
    """Finite differences against the backward with reset masks: RESET_AT's documents (a
    reset at a chunk's first token, inside a chunk, at token 0 and at the last token), chunks
    of 3 and 4 and one chunk of the whole call (dense), without and with decay. Fast mode:
    one random projection of the Jacobian on each side, which a wrong gradient entry moves
    (test_chunked_function_passes_gradcheck checks the whole Jacobian without resets)."""
    from bdh_train.model.chunked_grad import ChunkedAttention

    (q, v, rho0), _ = make_inputs(13, torch.float64, True, seed=12)
    mask = reset_mask_for(13)
    log_decay = LOG_DECAY if decay else None
    assert torch.autograd.gradcheck(
        lambda q, v, r: ChunkedAttention.apply(
            q, v, r, chunk_size, True, mask, False, log_decay, 0
        ),
        (q, v, rho0),
        fast_mode=True,  # u^T J w for random u, w against finite differences: 12 s -> 1 s
    )


@pytest.mark.parametrize("final_state", [True, False], ids=["final-state", "out-only"])
@pytest.mark.parametrize(
    ("executor", "chunk_size"), [("dense", 13), ("chunked", 3), ("chunked", 4)]
)
def test_resets_with_decay_in_the_function_equal_the_autograd_form(
    executor, chunk_size, final_state
):
    """The Function with resets and a fixed decay against the same executor's autograd form
    (the decay as a tensor that takes a gradient, which the dispatch keeps out of the
    Function: dense's masked products, chunked's chunk-by-chunk loop): outputs, final state
    and the gradients of q, v and rho0, fp64 to 1e-10 and fp32 to 1e-5. Two sets of
    documents: RESET_AT's, and a late reset (token 9) beside a row without one, whose later
    chunks read rho0 decayed by d^(kC) and whose final state carries it."""
    fn = EXECUTOR_FUNCTIONS[executor]
    late = torch.zeros(B, 13, dtype=torch.bool)
    late[0, 9] = True
    cases = [
        (mask, dtype, rtol)
        for mask in (reset_mask_for(13), late)
        for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-5))
    ]
    for mask, dtype, rtol in cases:
        results = []
        for log_decay in (LOG_DECAY, LOG_DECAY.clone().requires_grad_()):
            (q, v, rho0), (g_out, g_rho) = make_inputs(13, dtype, True, seed=16)
            out, final = fn(
                q,
                v,
                initial_state=rho0,
                log_decay=log_decay,
                chunk_size=chunk_size,
                output_final_state=final_state,
                reset_mask=mask,
            )
            through = type(out.grad_fn).__name__ == "ChunkedAttentionBackward"
            assert through == (not log_decay.requires_grad), (executor, dtype)
            loss = (out * g_out).sum() + ((final * g_rho).sum() if final_state else 0)
            grads = torch.autograd.grad(loss, (q, v, rho0))
            results.append((out.detach(), final, *grads))
        (got_out, got_final, *got), (ref_out, ref_final, *ref) = results
        what = f"{executor} C={chunk_size} {dtype} resets at {mask.nonzero().tolist()}"
        assert_close(got_out, ref_out, rtol=rtol, msg=f"{what}: out")
        if final_state:
            assert_close(got_final.detach(), ref_final.detach(), rtol=rtol, msg=f"{what}: state")
        else:
            assert got_final is None and ref_final is None
        for name, g, g_ref in zip(("q", "v", "rho0"), got, ref, strict=True):
            assert_close(g, g_ref, rtol=rtol, msg=f"{what}: grad of {name}")


def test_without_gradients_resets_compute_the_same():
    """The forward alone with reset masks equals the recorded call bit for bit."""
    (q, v, rho0), _ = make_inputs(13, torch.float64, True, seed=13)
    kwargs = dict(initial_state=rho0, chunk_size=4, reset_mask=reset_mask_for(13))
    recorded = mixer.chunked_attention(q, v, **kwargs)
    with torch.no_grad():
        plain = mixer.chunked_attention(q, v, **kwargs)
    assert torch.equal(plain[0], recorded[0]) and torch.equal(plain[1], recorded[1])


def heads_major_copy(x):
    """x [B, H, ...] as a heads-major view (a contiguous [H, B, ...] transposed), same values."""
    return x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(x.requires_grad)


@pytest.mark.parametrize("factors", ["none", "resets", "decay", "both"])
@pytest.mark.parametrize("value_heads", [1, H], ids=["shared-v", "per-head-v"])
@pytest.mark.parametrize(("executor", "chunk_size"), [("dense", 13), ("chunked", 4)])
def test_heads_major_queries_compute_what_contiguous_ones_do(
    executor, chunk_size, value_heads, factors
):
    """Queries laid out heads-major (as the projections leave them for long inputs) run
    through the Function on that layout: outputs, final state and the gradients of q, v and
    rho0 equal the contiguous call's, with and without a gradient recorded; the final state
    is a contiguous [B, H, N, D]. The sums are the same but a BLAS may pick its kernel, and so
    its order of summation, by the operands' strides (MKL on an AMD EPYC did, for dense):
    float64 to 1e-12."""
    from bdh_train.model.matmul import is_heads_major

    (q, v, rho0), (g_out, g_rho) = make_inputs(13, torch.float64, True, seed=14)
    if value_heads > 1:
        v = v.detach().expand(B, value_heads, 13, D).contiguous().requires_grad_()
    mask = reset_mask_for(13) if factors in ("resets", "both") else None
    log_decay = LOG_DECAY if factors in ("decay", "both") else None
    fn = EXECUTOR_FUNCTIONS[executor]
    kwargs = dict(chunk_size=chunk_size, reset_mask=mask, log_decay=log_decay)
    results = []
    for layout in (lambda x: x, heads_major_copy):
        qq, vv, rr = layout(q), layout(v) if value_heads > 1 else v, layout(rho0)
        assert is_heads_major(qq) == (layout is heads_major_copy)
        out, final = fn(qq, vv, initial_state=rr, **kwargs)
        node = out.grad_fn if layout is not heads_major_copy else out.grad_fn.next_functions[0][0]
        assert type(node).__name__ == "ChunkedAttentionBackward"
        assert final.is_contiguous()
        loss = (out * g_out).sum() + (final * g_rho).sum()
        grads = torch.autograd.grad(loss, (qq, vv, rr))
        with torch.no_grad():
            plain = fn(qq, vv, initial_state=rr, **kwargs)
        results.append((out.detach(), final.detach(), *grads, *plain))
    for name, got, expected in zip(
        ("out", "final", "dq", "dv", "drho0", "no-grad out", "no-grad final"),
        *results,
        strict=True,
    ):
        assert got.shape == expected.shape, name
        assert_close(got, expected, rtol=1e-12, msg=name)


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
@pytest.mark.parametrize(("executor", "chunk_size"), [("dense", 13), ("chunked", 4)])
def test_a_loss_on_the_final_state_alone(executor, chunk_size, decay):
    """Only the final state feeds the loss (the output's gradient never arrives: d_out is
    None in backward): gradients of q, v and rho0 equal autograd's through the products."""
    (q, v, rho0), (_, g_rho) = make_inputs(13, torch.float64, True, seed=15)
    log_decay = LOG_DECAY if decay else None
    _, final = EXECUTOR_FUNCTIONS[executor](
        q, v, initial_state=rho0, chunk_size=chunk_size, log_decay=log_decay
    )
    assert type(final.grad_fn).__name__ == "ChunkedAttentionBackward"
    got = torch.autograd.grad((final * g_rho).sum(), (q, v, rho0))
    _, ref_final = mixer.chunked_by_products(q, v, rho0, log_decay, chunk_size, True)
    expected = torch.autograd.grad((ref_final * g_rho).sum(), (q, v, rho0))
    for name, g, g_ref in zip(("q", "v", "rho0"), got, expected, strict=True):
        assert_close(g, g_ref, rtol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "no-grad"])
def test_heads_major_queries_without_a_final_state(recorded):
    """Heads-major queries and no final state asked for: the output equals the contiguous
    call's bit for bit and no state comes back."""
    (q, v, rho0), _ = make_inputs(13, torch.float64, True, seed=16)
    kwargs = dict(initial_state=rho0, chunk_size=4, output_final_state=False)
    with torch.set_grad_enabled(recorded):
        out, final = mixer.chunked_attention(heads_major_copy(q), v, **kwargs)
        expected, _ = mixer.chunked_attention(q, v, **kwargs)
    assert final is None and torch.equal(out, expected)


@pytest.mark.parametrize(("executor", "chunk_size"), VARIANTS)
def test_a_learned_decay_matches_the_definition_with_its_gradient(executor, chunk_size):
    """A decay that takes a gradient (alibi_learned) runs autograd's products in every
    executor: outputs, final state and the gradients of q, v, rho0 and the log-decay itself
    against the token-by-token definition (float64, 1e-10), T=13 (chunks padded)."""
    inputs, upstream = make_inputs(13, torch.float64, True, seed=17)
    learned = LOG_DECAY.clone().requires_grad_()
    out, final = EXECUTOR_FUNCTIONS[executor](
        *inputs[:2], initial_state=inputs[2], log_decay=learned, chunk_size=chunk_size
    )
    assert type(out.grad_fn).__name__ != "ChunkedAttentionBackward"
    loss = (out * upstream[0]).sum() + (final * upstream[1]).sum()
    got = torch.autograd.grad(loss, [*inputs, learned])
    ref_out, ref_final = definition(*inputs[:2], inputs[2], learned)
    ref_loss = (ref_out * upstream[0]).sum() + (ref_final * upstream[1]).sum()
    expected = torch.autograd.grad(ref_loss, [*inputs, learned])
    assert_close(out, ref_out, rtol=1e-10, msg="out")
    assert_close(final, ref_final, rtol=1e-10, msg="final state")
    for name, g, g_ref in zip(("q", "v", "rho0", "log_decay"), got, expected, strict=True):
        assert_close(g, g_ref, rtol=1e-10, msg=f"grad of {name}")


@pytest.mark.parametrize(
    ("executor", "log_decay", "runs_as_it_lies"),
    [
        ("dense", None, True),
        ("chunked", None, True),
        ("chunked", "fixed", True),
        ("chunked", "learned", False),
        ("dense", "learned", False),
        ("chunked", "fixed+resets", True),
        ("chunked", "learned+resets", False),
        ("recurrent", None, False),
    ],
)
def test_only_the_function_takes_heads_major_queries_as_they_lie(
    monkeypatch, executor, log_decay, runs_as_it_lies
):
    """linear_attention hands heads-major queries on uncopied where the executor runs the
    Function (it runs on that layout), and a contiguous copy to every other form; the
    output is the contiguous call's either way."""
    (q, v, rho0), _ = make_inputs(13, torch.float64, True, seed=18)
    decay = {
        None: None,
        "fixed": LOG_DECAY,
        "fixed+resets": LOG_DECAY,
        "learned": LOG_DECAY.clone().requires_grad_(),
        "learned+resets": LOG_DECAY.clone().requires_grad_(),
    }
    mask = reset_mask_for(13) if log_decay and log_decay.endswith("+resets") else None
    kwargs = dict(
        executor=executor,
        initial_state=rho0,
        log_decay=decay[log_decay],
        chunk_size=4,
        reset_mask=mask,
    )
    seen = []
    real = EXECUTOR_FUNCTIONS[executor]
    monkeypatch.setitem(
        EXECUTOR_FUNCTIONS, executor, lambda q, v, **kw: seen.append(q) or real(q, v, **kw)
    )
    out, final = linear_attention(heads_major_copy(q), v, **kwargs)
    expected, expected_final = linear_attention(q, v, **kwargs)
    assert is_heads_major(seen[0]) == runs_as_it_lies and seen[1].is_contiguous()
    assert_close(out, expected, rtol=1e-12, msg="out")
    assert_close(final, expected_final, rtol=1e-12, msg="final")


def test_a_one_token_dense_call_runs_the_function():
    """Every non-empty dense call takes the Function, a single token included."""
    (q, v, rho0), _ = make_inputs(1, torch.float64, True, seed=19)
    out, _ = mixer.dense_attention(q, v, initial_state=rho0)
    assert type(out.grad_fn).__name__ == "ChunkedAttentionBackward"


@pytest.mark.parametrize("n_chunks", [1, 2, 5])
@pytest.mark.parametrize("earlier", [True, False], ids=["earlier", "later"])
def test_running_sums_are_the_carry_products(n_chunks, earlier):
    """The CPU's chunk states (a running sum over the chunks) equal the [K, K] carry product
    other devices take, float64 to 1e-12, for the states (sums of earlier chunks) and for
    their gradient (sums of later ones); the first (last) chunk's sum is exactly 0."""
    from bdh_train.model.chunked_grad import carry_sums, running_sums

    generator = torch.Generator().manual_seed(3)
    parts = torch.randn(2, 3, n_chunks, 4, 5, dtype=torch.float64, generator=generator)
    got, expected = running_sums(parts, earlier), carry_sums(parts, earlier)
    assert_close(got, expected, rtol=1e-12)
    edge = 0 if earlier else -1
    assert torch.equal(got[:, :, edge], torch.zeros_like(got[:, :, edge]))
    if n_chunks > 1:
        second = 1 if earlier else -2
        assert torch.equal(got[:, :, second], parts[:, :, edge])


@pytest.mark.parametrize("by_product", [False, True], ids=["running-sums", "carry-product"])
def test_the_chunk_states_follow_the_device_choice(monkeypatch, by_product):
    """The CPU takes the chunk states (forward's S and backward's dW) as running sums
    (`sums_by_product('cpu')` is False; a GPU's True): the chunked Function runs the form
    chosen, twice a call, and either form gives the definition's outputs and gradients
    (float64 1e-10; 4 chunks with an incoming state and the final state)."""
    from bdh_train.model import chunked_grad

    assert chunked_grad.sums_by_product("cpu") is False
    assert chunked_grad.sums_by_product("cuda") is True
    calls = {"carry_sums": 0, "running_sums": 0}
    for name in calls:
        real = getattr(chunked_grad, name)

        def counted(parts, earlier, real=real, name=name):
            calls[name] += 1
            return real(parts, earlier)

        monkeypatch.setattr(chunked_grad, name, counted)
    if by_product:
        monkeypatch.setattr(chunked_grad, "sums_by_product", lambda device_type: True)
    check_against_definition("chunked", 4, 13, False, True, torch.float64, rtol=1e-10)
    ran = "carry_sums" if by_product else "running_sums"
    assert calls == {**{name: 0 for name in calls}, ran: 2}


# ------------------------------------------------------------------ the decay horizon
STEEP = torch.tensor([-12.0, -10.0], dtype=torch.float64)
"""Two heads whose state forgets within a few tokens: decay horizons of 5 and 6 tokens in
float32 and 31 and 37 in float64 (`decay_horizons`), all shorter than EDGE_T."""
MIXED = torch.tensor([-10.0, -0.05], dtype=torch.float64)
"""A fast head (horizon 6 in float32) beside a slow one whose horizon (875 in float32) is
longer than EDGE_T, as alibi_slow's three fast heads beside its slow one: the fast head reads
and writes the state at the call's edges, the slow one with every token."""
SPREAD = torch.tensor([-12.0, -0.05, -10.0, -0.04], dtype=torch.float64)
"""Fast and slow heads taken in turn: two horizons within EDGE_T (5 and 6 in float32), read
and written as far as the larger, and two past it, between fast ones."""
EDGE_T = 48


def test_each_head_s_decay_horizon_is_where_its_decay_powers_turn_zero():
    """By hand: float32's threshold is sqrt(tiny) = 1.0842e-19, ln(1 / it) = 43.668; alibi's
    heads (H = 4) decay at rates 2^(-h/4) = 1, 0.84090, 0.70711, 0.59460 a token, so their
    powers fall below the threshold past 43.668 / rate = 43.67, 51.93, 61.76, 73.44 tokens:
    floor + 2 = 45, 53, 63, 75. Float64's threshold 1.4917e-154 gives 354.16 / 0.59460 =
    595.6 for the slowest, so 597. alibi_slow's last head (rate 1/16): 698.7, so 700."""
    alibi = positions.alibi_log_decay(4)
    assert positions.decay_horizons(alibi, torch.float32) == [45, 53, 63, 75]
    assert positions.decay_horizons(alibi, torch.float64)[-1] == 597
    assert positions.decay_horizons(alibi, torch.bfloat16) == [45, 53, 63, 75]  # as float32's
    slow = positions.alibi_slow_log_decay(4)
    assert positions.decay_horizons(slow, torch.float32) == [45, 53, 63, 700]
    assert positions.decay_horizons(torch.tensor([-1.0, 0.0]), torch.float32) == [45, None]
    for log_decay in (alibi, slow, STEEP, MIXED, LOG_DECAY):
        for dtype in (torch.float32, torch.float64):
            horizons = positions.decay_horizons(log_decay, dtype)
            powers = positions.decay_powers(
                log_decay,
                torch.arange(max(h for h in horizons if h) + 40),
                torch.ones(1, dtype=dtype),
            )
            for head, w in enumerate(horizons):
                assert w is not None
                assert not powers[head, w:].any()  # from its horizon on, every power is 0
                assert powers[head, w - 2] > 0  # and it is no more than 2 past the last kept one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("resets", ["none", "documents", "inside"])
@pytest.mark.parametrize(
    ("with_state", "final"), [("grad", True), ("grad", False), ("detached", True), (None, True)]
)
@pytest.mark.parametrize("log_decay", [STEEP, MIXED, SPREAD], ids=["steep", "mixed", "spread"])
def test_reading_and_writing_the_state_at_its_edges_equals_the_whole_call(
    monkeypatch, dtype, resets, with_state, final, log_decay
):
    """A call past the decay horizon reads its incoming state with its first tokens only and
    writes its final state from its last ones only (`linear_attention`'s shortcut for dense
    calls); outputs, final states and every gradient equal the whole call (the slow twin:
    `dense_attention` called directly), in float32 to 1e-6 and in float64 to 1e-12. Resets at the
    start of rows (streamed documents) and inside them are applied to both edges. With MIXED
    and SPREAD, heads whose horizon reaches past the call read and write with every token.
    The incoming state with and without a gradient (TBPTT carries it detached)."""
    torch.manual_seed(7)
    heads = log_decay.shape[0]
    q = torch.randn(B, heads, EDGE_T, N, dtype=dtype).relu().requires_grad_()
    v = torch.randn(B, 1, EDGE_T, D, dtype=dtype, requires_grad=True)
    rho0 = None
    if with_state is not None:
        rho0 = torch.randn(B, heads, N, D, dtype=dtype, requires_grad=with_state == "grad")
    mask = None
    if resets != "none":
        mask = torch.zeros(B, EDGE_T, dtype=torch.bool)
        mask[0, 0] = True  # row 0 starts a document; row 1 continues its state
        if resets == "inside":
            mask[1, EDGE_T - 1] = True  # row 1's last document is its last token
            mask[0, 2] = True  # and row 0's a second one within the state's read
    seen: list[Tensor | None] = []
    whole = EXECUTOR_FUNCTIONS["dense"]

    def spy(*args, **kwargs):
        seen.append(kwargs["initial_state"])
        return whole(*args, **kwargs)

    monkeypatch.setitem(EXECUTOR_FUNCTIONS, "dense", spy)
    kwargs = dict(
        initial_state=rho0, log_decay=log_decay, output_final_state=final, reset_mask=mask
    )
    fast = linear_attention(q, v, executor="dense", **kwargs)
    slow = whole(q, v, **kwargs)
    assert seen == [None]  # the executor ran the call's own tokens only
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    inputs = [t for t in (q, v, rho0) if t is not None and t.requires_grad]
    up_out = torch.randn_like(slow[0])
    up_state = None if slow[1] is None else torch.randn_like(slow[1])
    results = []
    for out, state in (fast, slow):
        assert (state is None) == (not final)
        loss = (out * up_out).sum() + (0 if state is None else (state * up_state).sum())
        results.append([out, *([] if state is None else [state])])
        results[-1] += torch.autograd.grad(loss, inputs)
    for got, want in zip(*results, strict=True):
        assert_close(got, want, rtol=tol)


def test_the_shortcut_is_taken_only_for_a_fixed_decay_past_some_head_s_horizon():
    q = torch.zeros(1, 2, EDGE_T, N)
    rho0 = torch.zeros(1, 2, N, D)
    learned = STEEP.clone().requires_grad_()
    assert mixer.state_horizons(q, STEEP, "dense", rho0, True) == (5, 6)
    assert mixer.state_horizons(q, STEEP, "dense", None, True) == (5, 6)
    assert mixer.state_horizons(q, MIXED, "dense", rho0, True) == (6, EDGE_T)  # capped at T
    no_decay = torch.tensor([-10.0, 0.0], dtype=torch.float64)
    assert mixer.state_horizons(q, no_decay, "dense", rho0, True) == (6, EDGE_T)
    assert mixer.state_horizons(q, STEEP, "chunked", rho0, True) is None  # its chunks' states
    assert mixer.state_horizons(q, STEEP, "dense", None, False) is None  # no state to touch
    assert mixer.state_horizons(q, STEEP, "recurrent", rho0, True) is None
    assert mixer.state_horizons(q, None, "dense", rho0, True) is None  # rope: no decay
    assert mixer.state_horizons(q, learned, "dense", rho0, True) is None  # a learned decay
    assert mixer.state_horizons(q[:, :, :5], STEEP, "dense", rho0, True) is None  # within all
    assert mixer.state_horizons(q[:, :, :6], STEEP, "dense", rho0, True) == (5, 6)
    slow = positions.alibi_slow_log_decay(2)  # the slow head only past the call: nothing saved
    assert mixer.state_horizons(q, slow[1:], "dense", rho0, True) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_the_edges_keep_every_power_the_whole_call_keeps(dtype):
    """Element by element (no absolute tolerance): without values, the output is the
    incoming state's read alone, down to the slowest head's last power above the threshold
    (e^-40 of the first in float32, two tokens before the horizon); with one value, at that
    power's distance from the end, the final state is that token's write alone."""
    w = positions.decay_horizons(STEEP, dtype)[1]  # the slower head's
    assert w is not None
    q = torch.rand(B, 2, EDGE_T, N, dtype=dtype) + 0.5
    rho0 = torch.rand(B, 2, N, D, dtype=dtype) + 0.5
    v = torch.zeros(B, 1, EDGE_T, D, dtype=dtype)
    kwargs = dict(initial_state=rho0, log_decay=STEEP)
    fast, slow = linear_attention(q, v, executor="dense", **kwargs), dense_attention(q, v, **kwargs)
    assert slow[0][:, 1, w - 2].abs().min() > 0 and not slow[0][:, :, w:].any()
    assert torch.allclose(fast[0], slow[0], rtol=1e-6, atol=0.0)
    v[:, :, EDGE_T - (w - 2)] = 1.0  # written with the power d^(w - 2)
    fast, slow = linear_attention(q, v, executor="dense", **kwargs), dense_attention(q, v, **kwargs)
    assert fast[1] is not None and slow[1] is not None
    assert slow[1][:, 1].abs().min() > 0
    assert torch.allclose(fast[1], slow[1], rtol=1e-6, atol=0.0)
