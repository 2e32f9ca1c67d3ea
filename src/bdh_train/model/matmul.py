"""The shared per-head projection product, used by the float model and by the quantizers."""

from __future__ import annotations

import torch


def broadcasts_weight(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `per_head_matmul` runs as the broadcasting product (True) or as one GEMM with
    the weight used once (False), for inputs [B, 1|H, T, D] and a per-head weight [H, D, N].

    Broadcasting copies the weight per batch row (B*H*D*N) and, for a shared input, the input
    per head (B*H*T*D), and writes [B, H, T, N] in place; the folded GEMM writes [B, T, H, N]
    and copies it once into [B, H, T, N] (B*H*T*N, and again in backward). So broadcasting
    moves less memory once D*N + T*D < T*N: from T = 171 on for D = 128, N = 512, while a
    decoding step (T = 1) or a short prompt keeps the folded GEMM.
    """
    if weight.dim() != 3:
        return False
    _, d, n = weight.shape
    seq_len = inputs.shape[2]
    return d * n + seq_len * d < seq_len * n


def per_head_matmul(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs @ weight for inputs [B, 1|H, T, D] and a weight [H, D, N] or [K, N], as a
    contiguous tensor, in the form that moves the least memory (`broadcasts_weight`).

    For short inputs, `inputs @ weight` would expand (and save for backward) a [B, H, D, N]
    copy of the weight for a few tokens; folding batch and time into the GEMM's rows computes
    the same products with the weight used once.
    """
    if weight.dim() != 3 or broadcasts_weight(inputs, weight):
        return inputs @ weight
    heads, d, n = weight.shape
    batch, in_heads, seq_len, _ = inputs.shape
    if in_heads == 1:  # the dense input u, shared by all heads: one [B*T, D] x [D, H*N] GEMM
        out = inputs.reshape(batch * seq_len, d) @ weight.permute(1, 0, 2).reshape(d, heads * n)
        return out.view(batch, seq_len, heads, n).transpose(1, 2).contiguous()
    rows = inputs.transpose(0, 1).reshape(heads, batch * seq_len, d)
    out = torch.bmm(rows, weight)
    return out.view(heads, batch, seq_len, n).transpose(0, 1).contiguous()


def heads_matmul(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, M]: the heads of inputs [B, H, T, K] side by side ([B, 1, T, H*K]) times
    weight [H*K, M], in the form that moves the least memory.

    Side by side, the heads are first copied into [B, T, H, K] (B*H*T*K, and the gradient
    back in backward); as a sum of per-head products, the weight is copied per batch row
    (B*H*K*M) and the per-head results [B, H, T, M] are written and summed (2*B*H*T*M). The
    sum is taken from K*M + 2*T*M < T*K on: T > 256 for K = 512, M = 128.
    """
    batch, heads, seq_len, k = inputs.shape
    m = weight.shape[-1]
    if k * m + 2 * seq_len * m < seq_len * k:
        return (inputs @ weight.view(heads, k, m)).sum(dim=1, keepdim=True)
    return inputs.transpose(1, 2).reshape(batch, 1, seq_len, heads * k) @ weight


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
    if broadcasts_weight(inputs, weight):  # matmul's bmm over [B*H] and its sums of expands
        g3 = grad_out.reshape(batch * heads, seq_len, n)
        w3 = weight.expand(batch, heads, d, n).reshape(batch * heads, d, n)
        x3 = inputs.expand(batch, heads, seq_len, d).reshape(batch * heads, seq_len, d)
        grad_in = torch.bmm(g3, w3.mT).view(batch, heads, seq_len, d)
        if in_heads == 1:
            grad_in = grad_in.sum(dim=1, keepdim=True)
        return grad_in, torch.bmm(x3.mT, g3).view(batch, heads, d, n).sum(dim=0)
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
