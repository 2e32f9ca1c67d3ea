"""The shared per-head projection product, used by the float model and by the quantizers."""

from __future__ import annotations

import torch


def per_head_matmul(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs @ weight without broadcasting the weight over the batch.

    For a per-head weight [H, D, N], `inputs @ weight` on [B, 1|H, T, D] expands (and saves
    for backward) a [B, H, D, N] copy of the weight. Folding batch and time into the GEMM's
    rows computes the same products with the weight used once.
    """
    if weight.dim() != 3:
        return inputs @ weight
    heads, d, n = weight.shape
    batch, in_heads, seq_len, _ = inputs.shape
    if in_heads == 1:  # the dense input u, shared by all heads: one [B*T, D] x [D, H*N] GEMM
        out = inputs.reshape(batch * seq_len, d) @ weight.permute(1, 0, 2).reshape(d, heads * n)
        return out.view(batch, seq_len, heads, n).transpose(1, 2).contiguous()
    rows = inputs.transpose(0, 1).reshape(heads, batch * seq_len, d)
    out = torch.bmm(rows, weight)
    return out.view(heads, batch, seq_len, n).transpose(0, 1).contiguous()


def per_head_matmul_backward(
    inputs: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d inputs, d weight) of `per_head_matmul`, with the very products autograd would use,
    so a custom autograd Function built on it has bit-identical gradients."""
    if weight.dim() != 3:
        k, n = weight.shape
        rows = inputs.reshape(-1, k)
        g = grad_out.reshape(-1, n)
        return (g @ weight.mT).view(inputs.shape), rows.mT @ g
    heads, d, n = weight.shape
    batch, in_heads, seq_len, _ = inputs.shape
    if in_heads == 1:
        w2 = weight.permute(1, 0, 2).reshape(d, heads * n)
        g2 = grad_out.transpose(1, 2).reshape(batch * seq_len, heads * n)
        rows = inputs.reshape(batch * seq_len, d)
        grad_in = (g2 @ w2.mT).view(inputs.shape)
        grad_w = (rows.mT @ g2).view(d, heads, n).permute(1, 0, 2)
        return grad_in, grad_w
    rows = inputs.transpose(0, 1).reshape(heads, batch * seq_len, d)
    g3 = grad_out.transpose(0, 1).reshape(heads, batch * seq_len, n)
    grad_in = torch.bmm(g3, weight.mT).view(heads, batch, seq_len, d).transpose(0, 1)
    return grad_in, torch.bmm(rows.mT, g3)
