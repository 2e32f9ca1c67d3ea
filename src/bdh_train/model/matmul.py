"""The shared per-head projection products, used by the float model and by the quantizers.

Long inputs are multiplied head by head over all of a head's rows at once: one batched GEMM
of H products [B*T, D] x [D, N], whose result is kept heads-major ([H, B, T, N] in memory,
handed on as a [B, H, T, N] view: `heads_major`). Later elementwise passes keep that layout,
the mixer runs on it as it lies, and the next projection reads it without a copy."""

from __future__ import annotations

import torch

from bdh_train.model.recording import records_gradient


def heads_major(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `per_head_matmul` of inputs [B, 1|H, T, D] and a per-head weight [H, D, N]
    leaves its result heads-major (True) or contiguous [B, H, T, N] (False).

    Heads-major, the products are H GEMMs over B*T rows each and nothing is copied.
    Contiguous, a shared input is one GEMM [B*T, D] x [D, H*N] (per-head inputs: H GEMMs)
    and the result is copied into [B, H, T, N]: for a decoding step (T = 1) or a short
    prompt the wide GEMM uses the kernels better and the copy is small. The switch is at
    D*N + T*D < T*N (T = 171 for D = 128, N = 512), a threshold measured to pay on the CPU
    (benchmarks/bench_layout.py)."""
    if weight.dim() != 3:
        return False
    _, d, n = weight.shape
    seq_len = inputs.shape[2]
    return d * n + seq_len * d < seq_len * n


def is_heads_major(x: torch.Tensor) -> bool:
    """Whether x [B, H, ...] (at least 3 dims: rows of data per batch entry and head) is a
    view of a contiguous [H, B, ...] (and not itself contiguous)."""
    return x.dim() >= 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous()


def _own_backward_applies(inputs: torch.Tensor) -> bool:
    """Whether a product runs as one of this module's autograd Functions: outside autocast
    (which casts torch's products itself) and torch.compile (which differentiates them)."""
    return not torch.is_autocast_enabled(inputs.device.type) and not torch.compiler.is_compiling()


def _autocast_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows in autocast's dtype when autocast is on: cast before they are expanded over the
    heads, autocast would cast (and save for backward) the H-fold expanded copy."""
    device_type = rows.device.type
    if torch.is_autocast_enabled(device_type):
        return rows.to(torch.get_autocast_dtype(device_type))
    return rows


def _head_rows(inputs: torch.Tensor) -> torch.Tensor:
    """inputs [B, H, T, D] as [H, B*T, D] (a view when inputs are heads-major)."""
    batch, heads, seq_len, d = inputs.shape
    return inputs.transpose(0, 1).reshape(heads, batch * seq_len, d)


def per_head_matmul(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs @ weight for inputs [B, 1|H, T, D] and a weight [H, D, N] or [K, N]; a
    per-head product is heads-major for long inputs (`heads_major`), else contiguous.

    The weight is used once either way: `inputs @ weight` would expand (and save for
    backward) a [B, H, D, N] copy of it. Recording gradients outside autocast and
    torch.compile, a per-head product runs as `_PerHeadProducts`, whose backward is
    `per_head_matmul_backward`."""
    if weight.dim() != 3:
        return inputs @ weight
    if records_gradient(inputs, weight) and _own_backward_applies(inputs):
        return _PerHeadProducts.apply(inputs, weight)
    return per_head_products(inputs, weight)


class _PerHeadProducts(torch.autograd.Function):
    """`per_head_products` with `per_head_matmul_backward` as its backward. A heads-major
    result is a view made inside the Function: it must not be modified in place."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inputs, weight)
        return per_head_products(inputs, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs, weight = ctx.saved_tensors
        return per_head_matmul_backward(inputs, weight, grad)


def per_head_products(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`per_head_matmul` of a per-head weight [H, D, N] as torch products (what autograd,
    autocast and torch.compile see)."""
    heads, d, n = weight.shape
    batch, in_heads, seq_len, _ = inputs.shape
    if in_heads == 1:  # the dense input u, shared by all heads
        rows = inputs.reshape(batch * seq_len, d)
        if heads_major(inputs, weight):
            rows = _autocast_rows(rows)
            out = torch.bmm(rows.expand(heads, batch * seq_len, d), weight)
            return out.view(heads, batch, seq_len, n).transpose(0, 1)
        out = rows @ weight.permute(1, 0, 2).reshape(d, heads * n)  # one [B*T, D] x [D, H*N]
        return out.view(batch, seq_len, heads, n).transpose(1, 2).contiguous()
    out = torch.bmm(_head_rows(inputs), weight).view(heads, batch, seq_len, n).transpose(0, 1)
    return out if heads_major(inputs, weight) else out.contiguous()


def heads_matmul(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, M]: the heads of inputs [B, H, T, K] side by side ([B, 1, T, H*K]) times
    weight [H*K, M], in the form that moves the least memory.

    Side by side, the heads are first copied into [B, T, H, K] (B*H*T*K, and the gradient
    back in backward); as a sum of per-head products [H, B*T, K] x [K, M] (no copy of
    heads-major inputs), the per-head results [H, B*T, M] are written and summed
    (2*B*H*T*M). The sum is taken from K*M + 2*T*M < T*K on: T > 256 for K = 512, M = 128.
    """
    batch, heads, seq_len, k = inputs.shape
    _, m = weight.shape
    if k * m + 2 * seq_len * m < seq_len * k:
        rows, per_head = _head_rows(inputs), weight.view(heads, k, m)
        if _own_backward_applies(inputs):
            out = _SummedHeadProducts.apply(rows, per_head)
        else:
            out = torch.bmm(rows, per_head).sum(dim=0)
        return out.view(batch, 1, seq_len, m)
    return inputs.transpose(1, 2).reshape(batch, 1, seq_len, heads * k) @ weight


def summed_head_products(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_h rows_h @ weight_h for rows [H, R, K] and weight [H, K, M] -> [R, M], each head's
    product added into one [R, M] (addmm): no [H, R, M] of per-head results and no pass
    summing them. On the CPU 0.92 of `bmm(rows, weight).sum(0)`'s time for H=4, R=4096,
    K=512, M=128 (AMD EPYC, 2 threads). Not for tensors that record gradients."""
    out = torch.mm(rows[0], weight[0])
    for head in range(1, rows.shape[0]):
        out.addmm_(rows[head], weight[head])
    return out


class _SummedHeadProducts(torch.autograd.Function):
    """sum_h rows_h @ weight_h for rows [H, R, K] and weight [H, K, M] -> [R, M].

    Autograd would take the weight's gradient as rows_h^T @ grad ([K, M] out); here it is
    (grad^T @ rows_h)^T ([M, K] out, transposed back as a view): the same sums, in 0.70 of
    the time on the CPU for R = 4096, K = 512, M = 128."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        return summed_head_products(rows, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        heads, r, _ = rows.shape
        _, m = grad.shape
        grad_rows = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch.bmm(grad.expand(heads, r, m), weight.mT)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.bmm(grad.mT.expand(heads, m, r), rows).mT
        return grad_rows, grad_weight


SMALL_WEIGHT = 1 << 17
"""Per-head weights of at most this many elements a head (D * N) are copied transposed for
the input gradient's product; larger ones are read through the transposed view."""


def _transposed_for_rows(weight: torch.Tensor) -> torch.Tensor:
    """weight [H, D, N] transposed, for the product grad [H, R, N] x [H, N, D] over R rows.
    On the CPU the product with a contiguous copy takes 0.84 of the transposed view's time,
    the copy included, for H=4, D=128, N=512 (R=4096), and 1.06 for H=4, D=256, N=2048
    (R=2048), where the copy (8 MiB) is not repaid: small weights are copied, larger ones
    are not."""
    _, d, n = weight.shape
    return weight.mT.contiguous() if d * n <= SMALL_WEIGHT else weight.mT


def per_head_matmul_backward(
    inputs: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d inputs, d weight) of `per_head_matmul`, with autograd's products of
    `per_head_products`, a per-head product's input gradient by the weight's transpose as
    `_transposed_for_rows` gives it."""
    if weight.dim() != 3:
        k, n = weight.shape
        rows = inputs.reshape(-1, k)
        g = grad_out.reshape(-1, n)
        return (g @ weight.mT).view(inputs.shape), rows.mT @ g
    heads, d, n = weight.shape
    batch, in_heads, seq_len, _ = inputs.shape
    if in_heads == 1:
        rows = inputs.reshape(batch * seq_len, d)
        if heads_major(inputs, weight):
            g3 = _head_rows(grad_out)
            grad_in = summed_head_products(g3, _transposed_for_rows(weight)).view(inputs.shape)
            return grad_in, torch.bmm(rows.expand(heads, batch * seq_len, d).mT, g3)
        w2 = weight.permute(1, 0, 2).reshape(d, heads * n)
        g2 = grad_out.transpose(1, 2).reshape(batch * seq_len, heads * n)
        grad_in = (g2 @ w2.mT).view(inputs.shape)
        grad_w = (rows.mT @ g2).view(d, heads, n).permute(1, 0, 2)
        return grad_in, grad_w
    g3 = _head_rows(grad_out)
    grad_in = torch.bmm(g3, _transposed_for_rows(weight)).view(heads, batch, seq_len, d)
    grad_in = grad_in.transpose(0, 1)
    return grad_in, torch.bmm(_head_rows(inputs).mT, g3)
