"""Sharded data parallel: the model under FSDP2 (`torch.distributed.fsdp.fully_shard`).

BDH applies ONE set of layer weights n_layer times, so the whole model is one FSDP unit: its
parameters are gathered once per backward window (the forward calls before one backward:
one, or a TBPTT window's chunks) and stay gathered through that backward, then the gradients
are reduce-scattered and every rank keeps its shard (along each parameter's longest
dimension) of the parameters, their gradients and the optimizer state.

The train step calls `forward_hidden` and `loss_from_hidden` rather than `forward`; both are
registered as FSDP forward methods, so each call gets FSDP's gather and backward hooks. Every
backward (one per TBPTT window) reduce-scatters; the reduction SUMS (gradient divide factor
1, sum-only collectives, which gloo needs: it has no PREMUL_SUM), so the caller decides the
loss normalisation (`Trainer._sharded_gradients`: the micro-batch's loss sum over its global
count of targets).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Shard

from bdh_train.distributed.env import DistContext

FORWARD_METHODS = ("forward_hidden", "loss_from_hidden")
"""The model methods the train step and evaluation call; each needs FSDP's hooks."""


def shard_model(model: nn.Module, data_parallel: DistContext, device_type: str) -> nn.Module:
    """Shard `model` in place over the data-parallel processes (a 1-D device mesh "dp" of
    every process in the launch) and return it. Gradients are summed, never averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device_type, (data_parallel.world_size,), mesh_dim_names=("dp",))
    # One unit, kept whole from its forward through its backward (all TBPTT chunks of a
    # backward window share one gather), resharded after each backward.
    fully_shard(
        model, mesh=mesh, reshard_after_forward=False, shard_placement_fn=_largest_dimension
    )
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    model.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    # FSDP warns that forward_hidden returns a view; the step never writes into it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def _largest_dimension(param: nn.Parameter) -> Shard | None:
    """Shard each parameter along its longest dimension (the first of equals): the encoders'
    first dimension is the head count, often fewer than the processes, which would leave
    most ranks without a shard; their longest is the neuron dimension."""
    from torch.distributed.tensor import Shard

    if param.dim() == 0:
        return None
    return Shard(max(range(param.dim()), key=lambda dim: (param.shape[dim], -dim)))


def _is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor. No tensor can be one before `torch.distributed.tensor`
    is imported, and importing it costs about a second of start-up, so an unsharded run
    never does."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def is_sharded(model: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in model.parameters())


def local_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> this rank's shard of each parameter (plain tensors, for the accumulator's
    shape checks)."""
    return {name: _local(p) for name, p in model.named_parameters()}


def local_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> this rank's shard of each parameter's reduce-scattered gradient."""
    return {name: _local(p.grad) for name, p in model.named_parameters() if p.grad is not None}


def write_local_gradients(gradients: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Set each parameter's `.grad` to a DTensor over this rank's shard `gradients[name]`
    (None for a parameter without one)."""
    for name, param in model.named_parameters():
        grad = gradients.get(name)
        if grad is None:
            param.grad = None
            continue
        grad = grad.detach().to(device=param.device, dtype=param.dtype, copy=True)
        if _is_dtensor(param):
            grad = type(param).from_local(
                grad,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        param.grad = grad


def total_norm(value: torch.Tensor) -> float:
    """A gradient norm from `clip_grad_norm_` as a float (DTensor norms are the global
    norm once made whole)."""
    if _is_dtensor(value):
        value = value.full_tensor()
    return float(value)


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """The whole parameters in the model for the block (every rank must enter: the gather
    is a collective), sharded again afterwards; a no-op for an unsharded model."""
    if not is_sharded(model):
        yield
        return
    model.unshard()  # type: ignore[operator]
    try:
        yield
    finally:
        model.reshard()  # type: ignore[operator]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state on the main process (gathered one tensor at a time onto its
    CPU; an empty dict elsewhere). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # A model's state is tensors only (its typed ValueType also allows containers, ints, ...).
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
