"""per_head_matmul (the folded GEMM, or per-head GEMMs with a heads-major result) against
the plain broadcasting product, and its hand-written backward against autograd."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from bdh_train.model.matmul import (
    heads_major,
    heads_matmul,
    is_heads_major,
    per_head_matmul,
    per_head_matmul_backward,
    per_head_products,
)


@pytest.mark.parametrize(
    ("xs", "ws", "long"),
    [
        ((3, 1, 5, 4), (2, 4, 6), False),  # D*N + T*D = 44 > T*N = 30: the folded GEMM
        ((3, 2, 5, 4), (2, 4, 6), False),
        ((3, 1, 13, 4), (2, 4, 6), True),  # 76 < 78: per-head GEMMs, heads-major
        ((3, 2, 13, 4), (2, 4, 6), True),
        ((3, 1, 5, 12), (12, 4), False),
    ],
)
def test_equals_broadcasting_matmul_and_autograd(xs, ws, long):
    x = torch.randn(xs, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ws, dtype=torch.float64, requires_grad=True)
    assert heads_major(x, w) == long
    out = per_head_matmul(x, w)
    assert_close(out, x @ w, rtol=1e-12)
    assert (out.is_contiguous(), is_heads_major(out)) == (not long, long)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    mx, mw = per_head_matmul_backward(x.detach(), w.detach(), g)
    assert torch.equal(mx, gx) and torch.equal(mw, gw)  # per-head: the Function's backward
    if w.dim() == 3:  # its products against autograd's of the same forward products
        ax, aw = torch.autograd.grad(per_head_products(x, w), (x, w), g)
        assert_close(mx, ax, rtol=1e-12)
        assert_close(mw, aw, rtol=1e-12)
    bx, bw = torch.autograd.grad(x @ w, (x, w), g)
    assert_close(gx, bx, rtol=1e-12)
    assert_close(gw, bw, rtol=1e-12)


@pytest.mark.parametrize("seq_len", [3, 5, 12, 13, 40])
def test_heads_matmul_equals_the_heads_side_by_side(seq_len):
    """Both forms of heads_matmul (K*M + 2*T*M < T*K, 48 + 8T < 12T for K=12, M=4: up to 12
    tokens (the tie) keep the side-by-side GEMM, from 13 on the per-head sum) against the
    plain product, with gradients."""
    x = torch.randn(3, 2, seq_len, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, 4, dtype=torch.float64, requires_grad=True)
    out = heads_matmul(x, w)
    side_by_side = x.transpose(1, 2).reshape(3, 1, seq_len, 24)
    expected = torch.einsum("bhtk,hkm->btm", x, w.view(2, 12, 4)).unsqueeze(1)
    assert out.shape == (3, 1, seq_len, 4)
    nodes = [out.grad_fn, *(f for f, _ in out.grad_fn.next_functions)]
    summed = any(type(f).__name__ == "_SummedHeadProductsBackward" for f in nodes)
    assert summed == (seq_len > 12)  # the form taken
    assert_close(out, expected, rtol=1e-12)
    assert_close(out, side_by_side @ w, rtol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w), g)
    ref = torch.autograd.grad(expected, (x, w), g)
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b, rtol=1e-12)


@pytest.mark.parametrize("seq_len", [5, 13], ids=["short", "long"])
def test_heads_major_inputs_give_the_same_products_and_gradients(seq_len):
    """Inputs [B, H, T, D] laid out heads-major (the layer's attention output) against the
    same values contiguous: per_head_matmul, its hand-written backward and heads_matmul
    agree bit for bit, and a long product's result is heads-major."""
    x = torch.randn(3, 2, seq_len, 4, dtype=torch.float64)
    w = torch.randn(2, 4, 6, dtype=torch.float64)
    wd = torch.randn(2 * 4, 5, dtype=torch.float64)  # heads side by side (K=4, M=5)
    major = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert is_heads_major(major) and not is_heads_major(x)
    out, out_major = per_head_matmul(x, w), per_head_matmul(major, w)
    assert torch.equal(out, out_major) and is_heads_major(out_major) == (seq_len == 13)
    g = torch.randn_like(out)
    for got, expected in zip(
        per_head_matmul_backward(major, w, g), per_head_matmul_backward(x, w, g), strict=True
    ):
        assert torch.equal(got, expected)
    assert torch.equal(heads_matmul(major, wd), heads_matmul(x, wd))  # side by side
    y = torch.randn(3, 2, 40, 12, dtype=torch.float64)  # the sum over heads (K=12, M=5)
    y_major = y.transpose(0, 1).contiguous().transpose(0, 1)
    wy = torch.randn(2 * 12, 5, dtype=torch.float64)
    assert torch.equal(heads_matmul(y_major, wy), heads_matmul(y, wy))


@pytest.mark.parametrize("in_heads", [1, 2], ids=["shared-input", "per-head-input"])
def test_a_recorded_product_runs_the_function_and_others_the_products(in_heads):
    """With gradients recorded, a per-head product runs `_PerHeadProducts` (its backward is
    per_head_matmul_backward); without, under autocast, or for a 2-D weight it is torch's own
    products."""
    x = torch.randn(3, in_heads, 13, 4, requires_grad=True)
    w = torch.randn(2, 4, 6, requires_grad=True)
    assert type(per_head_matmul(x, w).grad_fn).__name__ == "_PerHeadProductsBackward"
    frozen = w.detach()  # a frozen weight: the input's gradient still runs the Function
    assert type(per_head_matmul(x, frozen).grad_fn).__name__ == "_PerHeadProductsBackward"
    frozen_input = x.detach()  # and a frozen input: the weight's gradient
    assert type(per_head_matmul(frozen_input, w).grad_fn).__name__ == "_PerHeadProductsBackward"
    with torch.no_grad():
        assert per_head_matmul(x, w).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(per_head_matmul(x, w).grad_fn).__name__ != "_PerHeadProductsBackward"
    flat = torch.randn(4, 6, requires_grad=True)
    assert type(per_head_matmul(x, flat).grad_fn).__name__ != "_PerHeadProductsBackward"


@pytest.mark.parametrize("in_heads", [1, 2], ids=["shared-input", "per-head-input"])
@pytest.mark.parametrize(
    "neurons", [64, 4096, 8192], ids=["copied-transpose", "at-the-bound", "transposed-view"]
)
def test_the_input_gradient_with_a_small_and_a_large_weight(in_heads, neurons):
    """The heads-major input's gradient takes a contiguous transpose of a weight of at most
    SMALL_WEIGHT elements and the transposed view of a larger one: both equal autograd's
    products (float64, 1e-12)."""
    from bdh_train.model.matmul import SMALL_WEIGHT, _transposed_for_rows

    d = 32
    w = torch.randn(2, d, neurons, dtype=torch.float64)
    assert _transposed_for_rows(w).is_contiguous() == (d * neurons <= SMALL_WEIGHT)
    x = torch.randn(2, in_heads, 200, d, dtype=torch.float64, requires_grad=True)
    w.requires_grad_()
    out = per_head_products(x, w)
    assert is_heads_major(out)
    g = torch.randn_like(out)
    expected = torch.autograd.grad(out, (x, w), g)
    got = per_head_matmul_backward(x.detach(), w.detach(), g)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, rtol=1e-12)


@pytest.mark.parametrize("needs", ["inputs", "weight"])
def test_the_summed_heads_with_one_operand_taking_a_gradient(needs):
    """The per-head sum's backward computes only the gradient asked for (frozen weights, or
    a frozen input), equal to autograd's of the plain product."""
    x = torch.randn(3, 2, 40, 12, dtype=torch.float64, requires_grad=needs == "inputs")
    w = torch.randn(24, 4, dtype=torch.float64, requires_grad=needs == "weight")
    out = heads_matmul(x, w)
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "_SummedHeadProductsBackward"
    leaf = x if needs == "inputs" else w
    g = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, leaf, g)
    side_by_side = x.transpose(1, 2).reshape(3, 1, 40, 24)
    (expected,) = torch.autograd.grad(side_by_side @ w, leaf, g)
    assert_close(got, expected, rtol=1e-12)


def test_heads_matmul_under_autocast_runs_torch_products():
    """Under autocast the per-head sum is torch's bmm and sum (autocast casts them): bf16
    results within bf16 rounding of the float32 product, and no hand-written node."""
    x = torch.randn(3, 2, 40, 12, requires_grad=True)
    w = torch.randn(24, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = heads_matmul(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 1, 40, 4)
    nodes = [out.grad_fn, *(f for f, _ in out.grad_fn.next_functions)]
    assert not any("_SummedHeadProducts" in type(f).__name__ for f in nodes)
    expected = x.transpose(1, 2).reshape(3, 1, 40, 24) @ w
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=5e-2)


def test_the_layout_rules_at_their_thresholds():
    """heads_major at its tie (D*N + T*D = T*N: 24 + 4T = 6T at T = 12 stays contiguous, 13
    goes heads-major) and is_heads_major from 3 dims on ([B, H, T] from [H, B, T]; a
    transposed matrix has no rows per head)."""
    w = torch.randn(2, 4, 6)
    assert not heads_major(torch.randn(1, 1, 12, 4), w)
    assert heads_major(torch.randn(1, 1, 13, 4), w)
    assert is_heads_major(torch.randn(3, 2, 5).transpose(0, 1))
    assert not is_heads_major(torch.randn(3, 2).t())
    assert not is_heads_major(torch.randn(2, 3, 5)) and not is_heads_major(torch.randn(5))


def test_under_autocast_a_shared_input_is_saved_once():
    """Under autocast the heads-major product casts the shared input before expanding it over
    the heads: backward keeps one [B*T, D] low-precision copy, not H of them."""
    u = torch.randn(2, 1, 300, 16, requires_grad=True)
    w = torch.randn(4, 16, 64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.shape, t.dtype, t.untyped_storage().nbytes()))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        out = per_head_matmul(u, w)
    assert out.dtype == torch.bfloat16 and is_heads_major(out)
    saved_inputs = [nbytes for shape, _, nbytes in saved if shape[-1] == 16 and shape[0] == 4]
    assert saved_inputs == [2 * 300 * 16 * 2]  # [H, B*T, D] expanded from one bf16 [B*T, D]
