"""The layer's gate y = x * relu(pre) (pre = a @ encoder_v) as one fused pass each way.

Autograd runs the gate as two passes forward (relu, the product) and three backward (the two
gradient products and relu's mask), each a full read and write of a [B, H, T, N] tensor; on a
2-core CPU those passes are memory-bound. `GateKernels(compiled=True)` holds the gate's
forward and backward written as two pure functions and compiled by inductor into one loop
each: forward reads x and pre once, backward reads the gradient, x and pre once and writes
both gradients.

The kernels compute exactly autograd's arithmetic (one product each, and relu's mask as a
select on the same comparison, NaN included), so the fused gate's values and gradients are
bit-identical to `x * relu(pre)`'s: a run gives the same weights with or without it.

Compiled with dynamic shapes, one graph serves every batch and length (a TBPTT tail
included); a new memory layout or dtype of the inputs builds one more (past dynamo's recompile
limit the functions run eagerly: the same values, slower).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bdh_train.model.recording import records_gradient


def gate_forward(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x * relu(pre)."""
    return x * torch.relu(pre)


def gate_backward(
    grad: torch.Tensor, x: torch.Tensor, pre: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dpre) of x * relu(pre) for dL/dy = grad: grad * relu(pre), and grad * x
    except where pre <= 0 (relu's mask: autograd's test, so a NaN passes as it does there)."""
    return grad * torch.relu(pre), torch.where(pre <= 0, 0.0, grad * x)


def _compiled(function):
    """`function` compiled by inductor with dynamic shapes (one graph: the gate's functions
    have no break). Where dynamo does not compile (under a torch dispatch mode such as
    FlopCounterMode) it runs as written: the same values, but dynamo then skips the function
    for good, so a FLOP count sets the kernels aside first (`train.throughput`)."""
    return torch.compile(function, dynamic=True)


class GateKernels:
    """The gate's two functions: compiled by inductor (`compiled`), or run eagerly as written
    (the twin the tests compare the compiled ones with)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled
        kernels = (gate_forward, gate_backward)
        self.forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
        self.backward: Callable[
            [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
        ]
        self.forward, self.backward = map(_compiled, kernels) if compiled else kernels


class _FusedGate(torch.autograd.Function):
    """x * relu(pre) through `kernels`; keeps x and pre (autograd's form keeps x and relu(pre),
    the same memory)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pre: torch.Tensor, kernels: GateKernels) -> torch.Tensor:
        ctx.kernels = kernels
        ctx.save_for_backward(x, pre)
        return kernels.forward(x, pre)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, pre = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the eager form, which autograd records
            grad_x, grad_pre = gate_backward(grad, x, pre)
        else:  # one loop writes both (a frozen side's is dropped by autograd)
            grad_x, grad_pre = ctx.kernels.backward(grad, x, pre)
        return grad_x, grad_pre, None


def gate(x: torch.Tensor, pre: torch.Tensor, kernels: GateKernels | None) -> torch.Tensor:
    """x * relu(pre): through `kernels` where given and a gradient is recorded (training);
    else autograd's composition: without kernels, inside torch.compile (which fuses it
    itself), and without gradients (evaluation and generation, whose inference mode would
    build graphs of their own)."""
    if kernels is None or not records_gradient(x, pre) or torch.compiler.is_compiling():
        return gate_forward(x, pre)  # under autograd: its own passes, its own backward
    return _FusedGate.apply(x, pre, kernels)
