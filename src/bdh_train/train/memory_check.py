"""Whether a train step fits: the estimate (`memory_estimate`) held against what this process
may use (`machine_memory`), the settings that would fit when it does not, and the lines
`bdh-train plan --memory` prints."""

from __future__ import annotations

from dataclasses import replace

import torch

from bdh_train.distributed.config import ParallelConfig
from bdh_train.distributed.env import resolve_device
from bdh_train.errors import ConfigError
from bdh_train.model.config import BDHConfig
from bdh_train.train.allocator import resolve_host_allocator
from bdh_train.train.config import TrainingConfig
from bdh_train.train.machine_memory import AvailableMemory, available_memory
from bdh_train.train.memory_estimate import (
    FLOAT32,
    OPTIMIZER_STATE,
    StepMemory,
    estimate_step_memory,
    format_bytes,
)


def process_share(
    model: BDHConfig, training: TrainingConfig, parallel: ParallelConfig, world_size: int
) -> tuple[int, int]:
    """(rows, layers) one of `world_size` processes trains: its data-parallel share of the
    batch's rows, and its pipeline stage's share of the layers."""
    if world_size <= 1:
        return training.batch_size, model.n_layer
    replicas, stages = parallel.mesh_shape(world_size)
    return -(-training.batch_size // replicas), -(-model.n_layer // stages)


def render_step_memory(
    estimate: StepMemory, model: BDHConfig, training: TrainingConfig, device_type: str
) -> str:
    """The estimate as the lines `bdh-train plan --memory` prints."""
    t = training
    accumulating = t.accumulation_steps > 1
    rows = [
        ("parameters", estimate.parameters, f"{model.parameter_count():,} parameters"),
        (
            "gradients",
            estimate.gradients,
            ".grad, the accumulator's sum and, at the optimizer step, its normalised copy "
            "(or the optimizer update's temporaries, the larger)"
            if estimate.activations == 0
            else ".grad and the accumulator's sum"
            if accumulating
            else ".grad",
        ),
        ("optimizer", estimate.optimizer, OPTIMIZER_STATE[estimate.optimizer_name]),
        (
            "activations",
            estimate.activations,
            f"batch {estimate.rows} x block {estimate.block_size}, {estimate.executor}, "
            f"recompute '{t.recompute}'"
            + (f", TBPTT chunks of {t.tbptt_chunk_size}" if t.tbptt_chunk_size else "")
            + (", bfloat16 autocast" if t.bfloat16_autocast(device_type) else ""),
        ),
    ]
    lines = [f"a train step's peak memory, estimated (one process, {device_type}):"]
    lines += [f"  {name:<12}{format_bytes(value):>11}   {what}" for name, value, what in rows]
    lines.append(
        f"  {'total':<12}{format_bytes(estimate.total):>11}   at its peak in {estimate.at}"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------- the check
def _advice(
    model: BDHConfig,
    training: TrainingConfig,
    device_type: str,
    share: tuple[int, int],
    room: int,
    optimizer: str,
) -> list[str]:
    """Settings that bring the step within `room` bytes, each changed alone: the largest
    batch that fits (a whole share of target_tokens_per_step where that is set), the
    cheaper recompute mode that fits, the longest TBPTT chunk (halving the block) that fits."""
    rows, layers = share
    t = training

    def fits(changed: TrainingConfig, rows: int = rows) -> bool:
        estimate = estimate_step_memory(model, changed, device_type, rows, layers, optimizer)
        return estimate.total <= room

    ways = []
    low, high = 0, rows  # low rows fit (0 trivially), high rows do not: grow low, shrink high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(t, middle) else (low, middle)
    replicas = max(t.batch_size // rows, 1)
    for smaller in range(low, 0, -1):  # the largest whole share of target_tokens_per_step
        batch = smaller * replicas
        if not t.target_tokens_per_step or t.target_tokens_per_step % (batch * t.block_size) == 0:
            ways.append(f"lower training.batch_size to {batch}")
            break
    for mode in ("mixer", "layer"):
        if mode != t.recompute and fits(replace(t, recompute=mode)):
            ways.append(f"set training.recompute = '{mode}'")
            break
    chunk = (t.tbptt_chunk_size or t.block_size) // 2
    while chunk >= 1 and not fits(replace(t, tbptt_chunk_size=chunk)):
        chunk //= 2
    if chunk >= 1:
        ways.append(f"set training.tbptt_chunk_size = {chunk}")
    return ways


def check_step_memory(
    model: BDHConfig,
    training: TrainingConfig,
    device: torch.device,
    share: tuple[int, int] | None = None,
    available: AvailableMemory | None = None,
    optimizer: str = "adamw",
) -> StepMemory:
    """The step's estimate (`estimate_step_memory` for a process training `share` = (rows,
    layers), default the whole batch and model, with `optimizer`); a ConfigError, before anything is
    allocated, when it exceeds what `available_memory` (or `available`) gives, with the
    figure and the settings that would fit."""
    rows, layers = share or (training.batch_size, model.n_layer)
    estimate = estimate_step_memory(model, training, device.type, rows, layers, optimizer)
    room = available or available_memory(device)
    if room.bytes < 0 or estimate.total <= room.bytes:
        return estimate
    where = f"{format_bytes(max(room.bytes, 0))} available ({room.source})"
    ways = _advice(model, training, device.type, (rows, layers), room.bytes, optimizer)
    if not ways:  # not even one row of one token: the weights' side alone
        alone = estimate.parameters + estimate.optimizer + model.parameter_count() * FLOAT32
        raise model.size_error(
            f"this process's {where} holds for training (the parameters, their gradients, "
            f"{OPTIMIZER_STATE[optimizer]}: {format_bytes(alone)})"
        )
    raise ConfigError(
        f"a train step needs {estimate.summary()}, at its peak in {estimate.at}; this process "
        f"has {where}: " + ", or ".join(ways)
    )


def plan_memory(model: BDHConfig, training: TrainingConfig, optimizer: str) -> list[str]:
    """`bdh-train plan --memory`'s lines: the estimate on training.device, what this process
    may use, whether the step fits (`train`'s check) and whether the heap keeps freed memory."""
    device = resolve_device(training.device)
    estimate = estimate_step_memory(model, training, device.type, optimizer=optimizer)
    lines = [render_step_memory(estimate, model, training, device.type)]
    room = available_memory(device)
    if room.bytes < 0:
        return [*lines, "this process's available memory is unknown here"]
    lines.append(f"this process has {format_bytes(room.bytes)} available ({room.source})")
    try:
        check_step_memory(model, training, device, available=room, optimizer=optimizer)
        lines.append("it fits")
    except ConfigError as exc:
        lines.append(f"it does not fit: `bdh-train train` would refuse it ({exc})")
    saving = training.recompute != "none"
    if resolve_host_allocator(training.host_allocator, device, saving) == "retain":
        lines.append(
            "training.host_allocator keeps freed memory in this process's heap here, so its "
            "resident set runs above the tensors' peak estimated here (docs/benchmarks.md, "
            '"Train-step memory")'
        )
    return lines
