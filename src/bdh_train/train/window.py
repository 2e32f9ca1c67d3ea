"""One optimizer step's accumulation window: each micro-batch's gradients accumulated with
its counted targets as the weight, reduced over the data-parallel ranks when the window
closes, then scaled, clipped and applied by the optimizer (or skipped when the loss or the
gradient is not finite).

How the window is reduced is a strategy picked once, so the loop has no branch for it:
`LocalReduction` (one process: the accumulator's mean), `DataParallelReduction` (each rank's
sums, then one SUM all-reduce of the gradients and weights and one of the loss sums) and
`ShardedReduction` (FSDP: each micro-batch's count of targets is all-reduced first and the
shards are reduce-scattered inside every backward, so the window adds only the loss sums).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from bdh_train.batch import SequenceBatch, StepOutput
from bdh_train.distributed import fsdp
from bdh_train.distributed.env import DistContext
from bdh_train.errors import BDHTrainError
from bdh_train.train.accumulate import WeightedGradientAccumulator, write_to_params
from bdh_train.train.config import TrainingConfig
from bdh_train.train.optim import OptimizerConfig
from bdh_train.train.profile import StepProfile, profile_row
from bdh_train.train.reduce import accumulate_sharded, all_reduce_accumulated, all_reduce_sums
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.state import TrainerState
from bdh_train.train.step import LanguageTrainModel, StepExecutor


class TrainingDiverged(BDHTrainError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient."""


class Reduction(Protocol):
    def add(self, batch: SequenceBatch) -> tuple[StepOutput, float]:
        """Run one micro-batch and accumulate its gradients; (its output, its loss sum)."""
        ...

    def finish(self, loss_sum: float, count: float) -> tuple[float, float]:
        """Write the window's exact token-weighted gradients into the parameters' `.grad`;
        (loss sum, count) over every data-parallel rank."""
        ...


class LocalReduction:
    """One process: the accumulator's token-weighted mean."""

    def __init__(
        self,
        executor: StepExecutor,
        accumulator: WeightedGradientAccumulator,
        model: torch.nn.Module,
    ) -> None:
        self.executor, self.accumulator, self.model = executor, accumulator, model

    def add(self, batch: SequenceBatch) -> tuple[StepOutput, float]:
        out = self.executor.compute_gradients(batch)
        self.accumulator.accumulate_mean(None, weight=out.counted)
        return out, float(out.loss) * out.counted

    def finish(self, loss_sum: float, count: float) -> tuple[float, float]:
        write_to_params(self.accumulator.finish_mean().gradients, self.model)
        return loss_sum, count


class DataParallelReduction(LocalReduction):
    """Data-parallel processes (DDP-style, or pipeline replicas): each rank's sums, then one
    SUM all-reduce of gradients and weights over `group` (`all_reduce_accumulated`)."""

    def __init__(
        self,
        executor: StepExecutor,
        accumulator: WeightedGradientAccumulator,
        model: torch.nn.Module,
        group: Any,
    ) -> None:
        super().__init__(executor, accumulator, model)
        self.group = group

    def finish(self, loss_sum: float, count: float) -> tuple[float, float]:
        grads = all_reduce_accumulated(
            self.accumulator.finish_sums(), self.model.named_parameters(), self.group
        )
        write_to_params(grads, self.model)
        loss_sum, count = all_reduce_sums([loss_sum, count], self.group)
        return loss_sum, count


class ShardedReduction:
    """A sharded (FSDP) model (`accumulate_sharded`: the loss sum over the micro-batch's
    global count of targets, reduce-scattered in the backward): the shards are already
    reduced, so the window needs only the accumulator's mean and the loss sums."""

    def __init__(
        self,
        executor: LanguageTrainModel,
        accumulator: WeightedGradientAccumulator,
        model: torch.nn.Module,
        group: Any,
    ) -> None:
        self.executor, self.accumulator, self.model, self.group = (
            executor,
            accumulator,
            model,
            group,
        )

    def add(self, batch: SequenceBatch) -> tuple[StepOutput, float]:
        return accumulate_sharded(self.executor, batch, self.accumulator, self.group)

    def finish(self, loss_sum: float, count: float) -> tuple[float, float]:
        fsdp.write_local_gradients(self.accumulator.finish_mean().gradients, self.model)
        loss_sum, count = all_reduce_sums([loss_sum, count], self.group)
        return loss_sum, count


def reduction_for(
    executor: StepExecutor,
    accumulator: WeightedGradientAccumulator,
    model: torch.nn.Module,
    data_parallel: DistContext,
) -> Reduction:
    """The strategy for this model and process group."""
    if fsdp.is_sharded(model):
        assert isinstance(executor, LanguageTrainModel)
        return ShardedReduction(executor, accumulator, model, data_parallel.group)
    if data_parallel.active:
        return DataParallelReduction(executor, accumulator, model, data_parallel.group)
    return LocalReduction(executor, accumulator, model)


class StepWindow:
    """The open accumulation window of `state` (its micro-step count and loss sums) and the
    optimizer step that closes it."""

    def __init__(
        self,
        model: Any,
        reduction: Reduction,
        optimizer: torch.optim.Optimizer,
        gradient_scales: GradientScaleSchedule,
        state: TrainerState,
        optim: OptimizerConfig,
        training: TrainingConfig,
        log: Callable[[str], None],
        last_good: Callable[[], str],
        timed: bool = False,
    ) -> None:
        """`log` prints a line; `last_good` says where the last good checkpoint is (for the
        message that stops a diverged run); `timed` (a profiled run) adds each step's whole
        time, `step_s`, to its row."""
        self.model, self.reduction, self.optimizer = model, reduction, optimizer
        self.gradient_scales, self.state, self.optim = gradient_scales, state, optim
        self.max_steps, self.max_skips = training.max_steps, training.max_consecutive_skips
        self.log, self.last_good, self.timed = log, last_good, timed
        self.profiles: list[StepProfile] = []
        self.started: float | None = None

    def micro_step(self, next_batch: Callable[[], SequenceBatch]) -> None:
        """Run the next micro-batch of the window (`next_batch` loads it onto the model's
        device; a profiled step's time includes the loading)."""
        s = self.state
        if self.timed and self.started is None:
            self.started = time.perf_counter()
        batch = next_batch()
        self.model.zero_grad(set_to_none=True)
        self.model.set_quant_step(s.step)  # the BitNet warm-up lambda follows the step
        out, loss_sum = self.reduction.add(batch)
        s.window_loss += loss_sum
        if "profile" in out.stats:
            self.profiles.append(out.stats["profile"])
        s.window_count += out.counted
        s.micro += 1

    def optimizer_step(self) -> dict[str, Any]:
        """Close the window: reduce, schedule, clip, step (or skip a non-finite step); the
        step's metrics row."""
        s = self.state
        loss_sum, count = self.reduction.finish(s.window_loss, s.window_count)
        self.gradient_scales.apply_(list(self.model.named_parameters()))
        params = [p for p in self.model.parameters() if p.grad is not None]
        # On shards, clip_grad_norm_ computes the global norm and clips every shard by it.
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim.clip_norm())
        grad_norm = fsdp.total_norm(norm)
        loss = loss_sum / max(count, 1.0)
        lr = self.optim.lr_at(s.step, self.max_steps)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            s.skips = 0
        else:
            self._skip(loss, grad_norm)
        self.model.zero_grad(set_to_none=True)
        s.step += 1
        s.micro = 0
        s.tokens += int(count)
        s.window_loss = s.window_count = 0.0
        row = {"step": s.step, "tokens": s.tokens, "loss": loss, "lr": lr, "grad_norm": grad_norm}
        if self.profiles:  # training.profile: this window's time and memory
            row |= profile_row(self.profiles)
            self.profiles = []
            if self.started is not None:  # the whole step: data, micro-steps, optimizer
                row["step_s"] = time.perf_counter() - self.started
        self.started = None
        return row

    def _skip(self, loss: float, grad_norm: float) -> None:
        s, limit = self.state, self.max_skips
        s.skips += 1
        self.log(
            f"step {s.step + 1}: non-finite loss {loss} or gradient norm {grad_norm}; step "
            f"skipped ({s.skips} in a row)"
        )
        if s.skips > limit:
            raise TrainingDiverged(
                f"{s.skips} consecutive steps had a non-finite loss or gradient "
                f"(training.max_consecutive_skips = {limit}); stopping; {self.last_good()}"
            )
