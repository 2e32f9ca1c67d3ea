"""per_head_matmul (the folded GEMM) against the plain broadcasting product, and its
hand-written backward against autograd."""

from __future__ import annotations

import pytest
import torch

from bdh_train.model.matmul import per_head_matmul, per_head_matmul_backward


@pytest.mark.parametrize(
    ("xs", "ws"), [((3, 1, 5, 4), (2, 4, 6)), ((3, 2, 5, 4), (2, 4, 6)), ((3, 1, 5, 12), (12, 4))]
)
def test_equals_broadcasting_matmul_and_autograd(xs, ws):
    x = torch.randn(xs, dtype=torch.float64, requires_grad=True)
    w = torch.randn(ws, dtype=torch.float64, requires_grad=True)
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
