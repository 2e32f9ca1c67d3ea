"""Real pipeline parallelism across processes with ``torch.distributed.pipelining``.

Every rank holds a FULL replica of the BDH parameters. BDH applies the same encoder, encoder_v,
decoder (and the optional affine norm) at every layer, so every stage needs them anyway; holding
embed and lm_head everywhere too keeps the replicas uniform and checkpointable from rank 0.
A stage runs only its contiguous layer range (from the planner) with a fresh state per
microbatch. After the schedule's backward, the gradients of ALL parameters are SUM-all-reduced
over the pipeline group (zeros where a rank did not use a parameter): the Megatron treatment of
tied weights, so every replica takes the identical optimizer step and stays bit-identical.

Loss scaling happens once: each microbatch's loss is a SUM over its counted targets divided by
the counted targets of the WHOLE batch (what the head counts, `heads.count_targets`), and the
schedule runs with ``scale_grads=False``, so pipeline gradients equal the single-process
mean-loss gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from bdh_train.batch import SequenceBatch, StepOutput
from bdh_train.distributed.config import check_equal_microbatches
from bdh_train.distributed.planner import PipelinePlan, StageAssignment
from bdh_train.errors import ConfigError, DataError
from bdh_train.model.bdh import BDH
from bdh_train.model.heads import count_targets
from bdh_train.utils import in_process_group

Schedule = PipelineScheduleSingle | PipelineScheduleMulti

TORCH_SCHEDULES: dict[str, tuple[type | None, type]] = {
    "gpipe": (ScheduleGPipe, ScheduleLoopedBFS),
    "1f1b": (Schedule1F1B, ScheduleInterleaved1F1B),
    "interleaved_1f1b": (None, ScheduleInterleaved1F1B),
}
"""Planner schedule name -> torch's (one stage per rank, several stages per rank) schedule."""

__all__ = ["BDHStage", "PipelineRunner"]


def _event_count(batch: SequenceBatch) -> float:
    """Summary events in the batch; -1 when it has no event mask."""
    mask = batch.summary_event_mask
    return -1.0 if mask is None else float((mask != 0).sum().item())


class BDHStage(nn.Module):
    """One virtual pipeline stage: a full BDH replica that runs only `layers`.

    The first stage takes token ids [mb, T] and embeds them; later stages take the previous
    stage's hidden [mb, T, D]. Every stage returns hidden [mb, T, D]; the last stage's loss is
    applied by the schedule's loss_fn. The summary event mask [mb, T], if any, is a keyword
    input: the schedule cuts it into microbatches on every rank from the batch each rank holds,
    so it never travels between stages. The replica is shared, not copied, between the virtual
    stages of one rank, so their gradients accumulate into the same tensors.
    """

    def __init__(self, model: BDH, layers: range, is_first: bool) -> None:
        super().__init__()
        if len(layers) == 0:
            raise ConfigError(f"a pipeline stage needs at least one layer, got {layers}")
        self.model = model
        self.layers = layers
        self.is_first = is_first

    def forward(
        self, x: torch.Tensor, summary_event_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden after this stage's layers."""
        mask = summary_event_mask
        if self.is_first:
            return self.model.forward_hidden(x, layers=self.layers, summary_event_mask=mask)
        # forward_hidden reads only the shape of idx when u is given.
        shape_only = torch.empty(x.shape[:2], dtype=torch.long, device=x.device)
        return self.model.forward_hidden(
            shape_only, layers=self.layers, u=x, summary_event_mask=mask
        )


class PipelineRunner:
    """Runs one rank's share of a pipeline-parallel train step.

    Collective: every rank of `group` must construct a runner and call `train_step` /
    `eval_loss` with the same batch, in the same order.
    """

    def __init__(
        self,
        model: BDH,
        plan: PipelinePlan,
        rank: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if plan.n_layer != model.config.n_layer:
            raise ConfigError(
                f"the pipeline plan was built for model.n_layer={plan.n_layer}, but the model "
                f"has {model.config.n_layer} layers"
            )
        if not in_process_group():
            raise ConfigError(
                "parallel.pipeline_stages > 1 needs an initialized torch.distributed process "
                "group (one process per stage)"
            )
        world = dist.get_world_size(group)
        if world != plan.stage_count:
            raise ConfigError(
                f"parallel.pipeline_stages={plan.stage_count} must equal the number of "
                f"processes in the pipeline group, got {world}"
            )
        if not 0 <= rank < plan.stage_count:
            raise ConfigError(f"pipeline rank must be in [0, {plan.stage_count}), got {rank}")
        if rank != dist.get_rank(group):
            raise ConfigError(
                f"pipeline rank {rank} differs from this process's rank in the group "
                f"({dist.get_rank(group)}); stage v runs on group rank v % pipeline_stages"
            )
        self.model = model
        self.plan = plan
        self.rank = rank
        self.group = group
        self.device = next(model.parameters()).device
        self._loss_denominator = 1.0
        total = plan.total_virtual_stages
        self._assignments: tuple[StageAssignment, ...] = plan.assignments_for_rank(rank)
        self.stage_modules = tuple(
            BDHStage(model, a.layer_range, a.virtual_stage_id == 0) for a in self._assignments
        )
        self.has_first = any(a.virtual_stage_id == 0 for a in self._assignments)
        self.has_last = any(a.virtual_stage_id == total - 1 for a in self._assignments)
        self._last_rank = (total - 1) % plan.stage_count
        self._batch_shape: tuple[int, int] | None = None
        self.stages, self.schedule = self._build_schedule()

    def _build_schedule(self) -> tuple[tuple[PipelineStage, ...], Schedule]:
        """Fresh PipelineStages and schedule; torch shapes their buffers on the first step."""
        total = self.plan.total_virtual_stages
        stages = tuple(
            PipelineStage(m, a.virtual_stage_id, total, self.device, group=self.group)
            for m, a in zip(self.stage_modules, self._assignments, strict=True)
        )
        single, multi = TORCH_SCHEDULES[self.plan.schedule]
        m = self.plan.microbatches
        if len(stages) == 1 and single is not None:
            return stages, single(stages[0], m, loss_fn=self._loss_fn, scale_grads=False)
        return stages, multi(list(stages), m, loss_fn=self._loss_fn, scale_grads=False)

    def _loss_fn(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Microbatch SUM loss over the whole batch's counted targets: scaled exactly once."""
        return self.model.loss_from_hidden(hidden, targets, reduction="sum") / (
            self._loss_denominator
        )

    def compute_gradients(self, batch: SequenceBatch) -> StepOutput:
        """Forward+backward of the whole batch through the pipeline; returns its mean loss.

        Gradients are REPLACED (zeroed first), then summed over the group so every replica
        holds the full gradient of the batch's mean loss; call the optimizer afterwards on
        every rank.
        """
        check_equal_microbatches(batch.batch_size, self.plan.microbatches)
        shape = (batch.batch_size, batch.block_size)
        if self._batch_shape is not None and shape != self._batch_shape:
            # The stages' send/recv buffers were shaped by the first batch; every rank sees
            # the same batch, so all of them rebuild here together.
            self.stages, self.schedule = self._build_schedule()
        self._batch_shape = shape
        batch = batch.to(self.device)
        # Known before the step from the whole batch, which every rank holds.
        counted = count_targets(batch.targets, self.model.config.language_head)
        self._check_same_batch(shape, counted, _event_count(batch))
        self._loss_denominator = max(1.0, counted)
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        args = (batch.inputs,) if self.has_first else ()
        target = batch.targets if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        mask: dict[str, Any] = {}
        if batch.summary_event_mask is not None:  # every stage slices it per microbatch
            mask["summary_event_mask"] = batch.summary_event_mask
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **mask)
        self.all_reduce_grads()
        loss = torch.zeros((), dtype=torch.float64)
        if losses:
            loss = torch.stack([x.detach().to(torch.float64) for x in losses]).sum().cpu()
        self._broadcast_tensor(loss, self._last_rank)
        return StepOutput(loss, counted)

    def state_dict(self) -> dict[str, Any]:
        """Nothing to carry: every microbatch starts from a fresh state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _check_same_batch(self, shape: tuple[int, int], counted: float, events: float) -> None:
        """Refuse, on every rank at once, batches that differ between ranks.

        Different shapes would leave a send without its receive (a hang); different counts
        would scale the microbatch losses differently; different summary event counts would
        give the stages different masks. One 8-float MAX all-reduce carries each value and its
        negation, so max == -min exactly when all ranks agree.
        """
        values = torch.tensor([*shape, counted, events], dtype=torch.float64)
        probe = torch.cat([values, -values])
        self._all_reduce_small(probe, dist.ReduceOp.MAX)
        high, low = probe[:4], -probe[4:]
        if not torch.equal(high, low):
            raise DataError(
                "every rank of a pipeline must pass the same batch to train_step; got "
                f"(batch_size, block_size, counted targets, summary events or -1) ranging "
                f"from {low.tolist()} to {high.tolist()} across ranks"
            )

    def all_reduce_grads(self) -> None:
        """SUM every parameter's gradient over the group (zeros where unused), in one bucket
        per dtype, so every replica takes the same optimizer step."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            pieces = flat.split([g.numel() for g in grads])
            for g, reduced in zip(grads, pieces, strict=True):
                g.copy_(reduced.view_as(g))

    @torch.no_grad()
    def eval_loss(self, batch: SequenceBatch) -> tuple[float, float]:
        """(loss sum, counted tokens) of `batch`, computed by the full replica on group rank 0
        and broadcast: cheaper than a forward-only pipeline pass for small eval batches and
        identical in value, since every rank holds all parameters."""
        batch = batch.to(self.device)
        result = torch.zeros(2, dtype=torch.float64)
        if self.rank == 0:
            was_training = self.model.training
            self.model.eval()
            try:
                hidden = self.model.forward_hidden(
                    batch.inputs, summary_event_mask=batch.summary_event_mask
                )
                loss_sum = self.model.loss_from_hidden(hidden, batch.targets, reduction="sum")
            finally:
                self.model.train(was_training)
            counted = torch.tensor(
                count_targets(batch.targets, self.model.config.language_head),
                dtype=torch.float64,
            )
            result = torch.stack([loss_sum.detach().double().cpu(), counted])
        self._broadcast_tensor(result, 0)
        return float(result[0]), float(result[1])

    def _collective_device(self) -> torch.device:
        """NCCL only moves CUDA tensors; gloo takes CPU ones."""
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _all_reduce_small(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        buf = tensor.to(self._collective_device())
        dist.all_reduce(buf, op=op, group=self.group)
        tensor.copy_(buf.cpu())

    def _broadcast_tensor(self, tensor: torch.Tensor, group_rank: int) -> None:
        """Broadcast a small CPU tensor in place from a rank of the pipeline group."""
        buf = tensor.to(self._collective_device())
        dist.broadcast(buf, group_src=group_rank, group=self.group)
        tensor.copy_(buf.cpu())
