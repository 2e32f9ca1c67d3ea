"""Token-weighted gradient reduction across data-parallel ranks.

DDP's default averages per-rank gradients equally, which is wrong when ranks saw different
numbers of tokens (or none). Here every rank contributes its loss-SUM gradients and its
effective weight; one SUM all-reduce adds them, and the result is divided by the loss scale and
then by the global weight once. Any split of the global batch over ranks and microbatches
therefore gives the single-process gradient of the global mean loss.

A sharded (FSDP) model reduces inside every backward instead; `accumulate_sharded` puts the
global weight into the loss before it (see there).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from bdh_train.batch import SequenceBatch, StepOutput
from bdh_train.distributed import fsdp
from bdh_train.train.accumulate import (
    AccumulatedGradients,
    EmptyWeightError,
    GradientError,
    InvalidWeightError,
    NamedParams,
    WeightedGradientAccumulator,
    named_parameter_dict,
    normalize_gradients,
)
from bdh_train.train.step import LanguageTrainModel
from bdh_train.utils import in_process_group

__all__ = ["accumulate_sharded", "all_reduce_accumulated", "all_reduce_sums"]

_DTYPE_CODES = {torch.float32: 32.0, torch.float64: 64.0}


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL only reduces CUDA tensors; every other backend here takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_same_window_settings(
    result: AccumulatedGradients, group: dist.ProcessGroup | None = None
) -> None:
    """Raise GradientError on every rank unless all ranks used the same loss scale and dtype.

    A mismatch would silently mis-scale the sum (loss scale) or make the buckets of
    `all_reduce_accumulated` differ in dtype (dtype). Costs one small MAX all-reduce; a no-op
    without an initialized process group.
    """
    if not in_process_group():
        return
    scale = result.state.loss_scale
    code = _DTYPE_CODES.get(result.state.dtype, 0.0)
    # max(x) and max(-x) = -min(x): one MAX reduction gives both extremes of each setting.
    probe = torch.tensor(
        [scale, -scale, code, -code], dtype=torch.float64, device=_collective_device(group)
    )
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    hi_scale, neg_lo_scale, hi_code, neg_lo_code = probe.tolist()
    if hi_scale != -neg_lo_scale or hi_code != -neg_lo_code:
        raise GradientError(
            f"ranks disagree on the accumulation window: loss scale in "
            f"[{-neg_lo_scale!r}, {hi_scale!r}], dtype code in [{-neg_lo_code}, {hi_code}]"
        )


def all_reduce_accumulated(
    result: AccumulatedGradients,
    named_params: NamedParams,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Globally token-weighted mean gradients from each rank's `finish_sums()` result.

    One SUM all-reduce of a flat bucket in the work dtype holding, in sorted-name order, every
    parameter's gradient (zeros where this rank has none), then this rank's total weight, then
    a presence mask, so a parameter no rank produced stays absent rather than becoming zeros.
    The sum is divided by the loss scale and then by the global weight. A global weight of 0
    raises EmptyWeightError on every rank. In float32 the weights are summed in float32 (exact
    for integer token counts below 2**24).

    Without an initialized process group this is the single-process `finish_mean`.
    """
    state = result.state
    params = named_parameter_dict(named_params)
    for name, grad in result.gradients.items():
        if name not in params:
            raise GradientError(f"gradient for unknown parameter {name!r}")
        if grad.shape != params[name].shape:
            raise GradientError(
                f"gradient for parameter {name!r} has shape {tuple(grad.shape)}, "
                f"expected {tuple(params[name].shape)}"
            )
        if grad.dtype != state.dtype:
            raise GradientError(
                f"gradient for parameter {name!r} is {grad.dtype}, work dtype is {state.dtype}"
            )
    if not in_process_group():
        return normalize_gradients(result.gradients, state.loss_scale, state.total_weight)
    _check_same_window_settings(result, group)

    names = sorted(params)
    sizes = [params[name].numel() for name in names]
    grad_numel = sum(sizes)
    weight_at = grad_numel
    bucket = torch.zeros(
        grad_numel + 1 + len(names), dtype=state.dtype, device=_collective_device(group)
    )
    offset = 0
    for name, size in zip(names, sizes, strict=True):
        gradient = result.gradients.get(name)  # (`grad` above is typed Tensor, not Optional)
        if gradient is not None:
            bucket[offset : offset + size].copy_(gradient.detach().reshape(-1))
        offset += size
    # Weight and presence mask go in with one host-to-device copy, not one per parameter.
    tail = [state.total_weight] + [float(name in result.gradients) for name in names]
    bucket[weight_at:].copy_(torch.tensor(tail, dtype=state.dtype))

    dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=group)

    reduced_tail = bucket[weight_at:].tolist()
    global_weight, present = reduced_tail[0], reduced_tail[1:]
    if not math.isfinite(global_weight):
        raise InvalidWeightError(f"global weight {global_weight!r} in {state.dtype}")
    if not global_weight > 0.0:
        raise EmptyWeightError(f"global weight over all ranks is {global_weight!r}")
    summed: dict[str, torch.Tensor] = {}
    offset = 0
    for index, (name, size) in enumerate(zip(names, sizes, strict=True)):
        if present[index] > 0.0:
            param = params[name]
            summed[name] = bucket[offset : offset + size].view(param.shape).to(param.device)
        offset += size
    return normalize_gradients(summed, state.loss_scale, global_weight)


def all_reduce_sums(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """The element-wise sums of `values` over the ranks of `group`, in float64 (evaluation's
    loss sums and counts); the values themselves without an initialized process group."""
    if not in_process_group():
        return list(values)
    sums = torch.tensor(values, dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return sums.tolist()


def accumulate_sharded(
    step: LanguageTrainModel,
    batch: SequenceBatch,
    accumulator: WeightedGradientAccumulator,
    group: dist.ProcessGroup | None = None,
) -> tuple[StepOutput, float]:
    """One micro-batch of a sharded (FSDP) model, exactly token-weighted; returns the step's
    output and this rank's loss sum.

    FSDP reduce-scatters (sums, divide factor 1) the gradients inside every backward, before
    any accumulator sees them, so each rank's loss must already carry its final weight: one
    SUM all-reduce of the micro-batch's counted targets gives the global count G, every rank
    back-propagates its loss SUM / G (over all its TBPTT windows), and the summed shard is this
    rank's part of the gradient of the micro-batch's global mean loss, however the targets
    fall on the ranks. The accumulator adds the local shards with weight G, so its
    `finish_mean` is the window's single-process token-weighted gradient shard, with no
    further reduction. The accumulator must be built over `fsdp.local_parameters`."""
    counted = step.counted_targets(batch)
    (global_count,) = all_reduce_sums([counted], group)
    normalizer = max(global_count, 1.0)
    out = step.compute_gradients(batch, normalizer=normalizer)
    accumulator.accumulate_mean(fsdp.local_gradients(step.model), weight=global_count)
    return out, float(out.loss) * normalizer
