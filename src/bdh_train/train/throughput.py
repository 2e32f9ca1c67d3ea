"""Throughput in model FLOPs: a training step's FLOPs per token, counted once at the start of a
run from the step executor that trains, and the machine's peak FLOP/s, measured once by a short
matrix product; the share of that peak a step's tokens per second reach is the MFU that the
loss lines and metrics.jsonl report (as nanoGPT and torchtitan print it).

The count is torch's `FlopCounterMode` over one forward and backward of one row of the run's
block through the run's executor and model (its executor choice, TBPTT chunks, autocast and
head as they train): the matrix products' FLOPs (2 per multiply-add), elementwise work not
counted, as MFU conventionally counts. The compiled layer runs eagerly for the count (the same
products) and recompute is off (MFU counts a step's forward once). Nothing of the run changes:
the random generators are restored and the gradients cleared.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from bdh_train.batch import SequenceBatch
from bdh_train.data.config import DataConfig
from bdh_train.data.eval_windows import eval_batches
from bdh_train.data.tokens import TokenData
from bdh_train.distributed import fsdp
from bdh_train.model.bdh import BDH
from bdh_train.train.config import TrainingConfig
from bdh_train.train.profile import NullProfiler
from bdh_train.train.step import LanguageTrainModel


def _baddbmm_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    (batch, rows, inner), cols = a_shape, b_shape[-1]
    return 2 * batch * rows * inner * cols


IN_PLACE_PRODUCTS = {torch.ops.aten.baddbmm_: _baddbmm_flops}
"""custom_mapping for torch's FlopCounterMode, which knows baddbmm but not its in-place
form, the one the executors accumulate with."""


@contextlib.contextmanager
def _as_written(model: BDH) -> Iterator[None]:
    """`model` with its compiled layer (whose first call would fix the shape it compiles for),
    its compiled gate kernels (dynamo, first called under the counter's dispatch mode, would
    skip them for good) and recompute set aside: the same products, run as written."""
    compiled, recompute, kernels = model._compiled_layer, model.recompute, model._gate_kernels
    model._compiled_layer = None
    model.use_fused_gate(None)
    model.set_recompute("none")
    try:
        yield
    finally:
        model._compiled_layer = compiled
        model.use_fused_gate(kernels)
        model.set_recompute(recompute)


def train_flops_per_token(executor: object, batch: SequenceBatch) -> float | None:
    """FLOPs of a training step per token (module docstring) of `executor` on `batch` (one
    row of the run's block); None for an executor this cannot count (a pipeline's, or one
    whose model FSDP shards: its forward gathers across processes)."""
    if not isinstance(executor, LanguageTrainModel) or fsdp.is_sharded(executor.model):
        return None
    counted = copy.copy(executor)  # the same model and settings; no carried state, no timing
    counted.streaming, counted.carried_state, counted.profiler = False, None, NullProfiler()
    counted.pipeline_plan = None  # an emulated pipeline's microbatches do the same products
    model = executor.model
    device = batch.inputs.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices), _as_written(model):
        with FlopCounterMode(display=False, custom_mapping=IN_PLACE_PRODUCTS) as counter:
            counted.compute_gradients(batch)
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / batch.inputs.numel()


PEAK_MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}
"""The square matrix product the peak is measured with, per device type (on 2 idle CPU cores
1024 measured 140 GFLOP/s in 0.09 s, 2048 132 GFLOP/s in 0.7 s)."""


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """This device's matrix-product rate right now, in FLOP/s: the best of 3 products of two
    PEAK_MATMUL_SIZE-square matrices of `dtype` (the run's compute dtype) after one warm-up,
    on torch's current threads."""
    size = PEAK_MATMUL_SIZE.get(device.type, 1024)
    own = torch.Generator(device).manual_seed(0)  # the run's random streams stay untouched
    a = torch.randn(size, size, device=device, dtype=dtype, generator=own)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=own)
    best = float("inf")
    for i in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


def run_throughput(
    executor: object,
    data: TokenData,
    training: TrainingConfig,
    data_config: DataConfig,
    device: torch.device,
    devices: int,
) -> Throughput | None:
    """A run's `Throughput`: the FLOPs per token of `executor` on the first block of `data`
    (its training split), and the peak of `devices` devices, training.peak_flops each or
    measured on this one; None where the executor is not counted."""
    t = training
    window = eval_batches(data, t.block_size, 1, 1, data_config.summary_trigger())
    flops = train_flops_per_token(executor, next(window).to(device))
    if flops is None:
        return None
    if t.peak_flops:
        peak, source = t.peak_flops, "training.peak_flops"
    else:
        dtype = torch.bfloat16 if t.bfloat16_autocast(device.type) else torch.float32
        size = PEAK_MATMUL_SIZE.get(device.type, 1024)
        peak = measure_peak_flops(device, dtype)
        source = f"a {size}-square {str(dtype).removeprefix('torch.')} product measured at start"
    if devices > 1:
        source += f", x {devices} devices"
    return Throughput(flops, peak * devices, source)


@dataclass(frozen=True)
class Throughput:
    """A run's FLOPs per token and the peak of all its devices together: MFU of a rate."""

    flops_per_token: float
    peak_flops: float
    """FLOP/s of every device of the run together (one device's measured peak x devices)."""
    peak_source: str
    """How the peak was obtained, in words."""

    def mfu(self, tokens_per_s: float) -> float:
        """The share of the peak that `tokens_per_s` training tokens per second reach."""
        return tokens_per_s * self.flops_per_token / self.peak_flops

    def describe(self) -> str:
        """The start banner's line."""
        return (
            f"{_si(self.flops_per_token)}FLOP per token (a training step's, counted); peak "
            f"{_si(self.peak_flops)}FLOP/s ({self.peak_source})"
        )


def _si(value: float) -> str:
    """3 significant digits with an SI prefix and a space: '1.23 M', '456 G'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "
