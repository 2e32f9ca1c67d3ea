"""per_head_matmul (the folded GEMM) against the plain broadcasting product, and its
hand-written backward against autograd."""

from __future__ import annotations

import pytest
import torch

from bdh_train.model.matmul import (
    broadcasts_weight,
    heads_matmul,
    per_head_matmul,
    per_head_matmul_backward,
)


@pytest.mark.parametrize(
    ("xs", "ws", "broadcasts"),
    [
        ((3, 1, 5, 4), (2, 4, 6), False),  # D*N + T*D = 44 > T*N = 30: the folded GEMM
        ((3, 2, 5, 4), (2, 4, 6), False),
        ((3, 1, 13, 4), (2, 4, 6), True),  # 76 < 78: the broadcasting product
        ((3, 2, 13, 4), (2, 4, 6), True),
        ((3, 1, 5, 12), (12, 4), False),
    ],
)
def test_equals_broadcasting_matmul_and_autograd(xs, ws, broadcasts):
    x = torch.randn(xs, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ws, dtype=torch.float64, requires_grad=True)
    assert broadcasts_weight(x, w) == broadcasts
    out = per_head_matmul(x, w)
    torch.testing.assert_close(out, x @ w, rtol=1e-12, atol=1e-12)
    assert out.is_contiguous()
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    mx, mw = per_head_matmul_backward(x.detach(), w.detach(), g)
    assert torch.equal(mx, gx) and torch.equal(mw, gw)
    bx, bw = torch.autograd.grad(x @ w, (x, w), g)
    torch.testing.assert_close(gx, bx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, bw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq_len", [3, 40], ids=["side-by-side", "sum-over-heads"])
def test_heads_matmul_equals_the_heads_side_by_side(seq_len):
    """Both forms of heads_matmul (K*M + 2*T*M against T*K: 3 tokens keep the side-by-side
    GEMM, 40 take the per-head sum for K=12, M=4) against the plain product, with gradients."""
    x = torch.randn(3, 2, seq_len, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, 4, dtype=torch.float64, requires_grad=True)
    out = heads_matmul(x, w)
    side_by_side = x.transpose(1, 2).reshape(3, 1, seq_len, 24)
    expected = torch.einsum("bhtk,hkm->btm", x, w.view(2, 12, 4)).unsqueeze(1)
    assert out.shape == (3, 1, seq_len, 4)
    assert (type(out.grad_fn).__name__ == "SumBackward1") == (seq_len == 40)  # the form taken
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, side_by_side @ w, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w), g)
    ref = torch.autograd.grad(expected, (x, w), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
