"""The language train step: one object that owns the model and the step policies.

  * TBPTT: the block is cut into chunks along time; every `backprop_chunks` chunks run
    forward then backward together, then the state is detached, so activation memory is that
    of those chunks, not of the block;
  * streaming: the detached state is carried to the next call; the batch's reset mask
    (`SequenceBatch.reset_mask`, sliced with the tokens per chunk) restarts a row at position 0
    from a zero state exactly at the token where its next document begins, mid-chunk
    included, while the other rows continue;
  * pipeline microbatches: the batch is split and each microbatch runs the plan's layer
    ranges in its forward-event order with a fresh state (single-process emulation);
  * the batch's summary event and reset masks, if any, go with its tokens into every forward
    (sliced with them per chunk and per microbatch);
  * gradient-scale schedules, applied after backward by `train_step`;
  * profiling hooks that cost nothing when off, and in 'detail' mode timed probes: extra
    passes on the step's batch that leave everything the step computes unchanged.

Losses are token-weighted: every piece (TBPTT chunk, microbatch) contributes its loss SUM
divided by the counted targets of the whole block — counted by the model's head
(`heads.count_targets`) — so the pieces add up to the head's mean loss of the block exactly,
whatever the chunk lengths, ignored targets or ids the head does not count.

`StepExecutor` is what the trainer drives; this class and the multi-process pipeline runner
implement it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from bdh_train.batch import SequenceBatch, StepOutput
from bdh_train.distributed.planner import PipelinePlan, split_microbatch_ranges
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.model import BDH, ModelState
from bdh_train.model.heads import count_targets, token_cross_entropy
from bdh_train.train.profile import NullProfiler, StepProfiler
from bdh_train.train.schedules import GradientScaleSchedule


def _columns(mask: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Time steps [start, end) of an optional [B, T] mask."""
    return None if mask is None else mask[:, start:end]


class StepExecutor(Protocol):
    """Runs one micro-batch for the trainer."""

    def compute_gradients(self, batch: SequenceBatch) -> StepOutput:
        """Forward and backward of `batch`; the gradients of its mean loss land in `.grad`
        (added to what is there)."""
        ...

    def eval_loss(self, batch: SequenceBatch) -> tuple[float, float]:
        """(loss sum over counted targets, counted targets), without a graph or state change."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LanguageTrainModel:
    """The language train step of one process (a `StepExecutor`): owns the model and runs
    each block's forward and backward with this module's policies (TBPTT, streaming state,
    emulated pipeline microbatches, gradient-scale schedules, profiling).

    `compute_gradients` adds the gradients of the block's mean loss to `.grad`; `train_step`
    zeroes them first and applies the gradient-scale schedule after; `eval_loss` and
    `valid_step` compute losses without a graph. `state_dict` holds the schedule's counter
    and the carried streaming state.
    """

    def __init__(
        self,
        model: BDH,
        tbptt_chunk_size: int = 0,
        tbptt_backprop_chunks: int = 1,
        streaming: bool = False,
        pipeline_plan: PipelinePlan | None = None,
        gradient_scales: GradientScaleSchedule | None = None,
        profiler: StepProfiler | NullProfiler | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        """`streaming` carries the state from one call to the next (the batch's reset mask
        starts rows over); `pipeline_plan` emulates a pipeline's microbatches in this process."""
        if pipeline_plan is not None and pipeline_plan.n_layer != model.config.n_layer:
            raise ConfigError(
                f"the pipeline plan covers {pipeline_plan.n_layer} layers but model.n_layer is "
                f"{model.config.n_layer}"
            )
        self.model = model
        self.tbptt_chunk_size = tbptt_chunk_size
        self.tbptt_backprop_chunks = tbptt_backprop_chunks
        self.streaming = streaming
        self.pipeline_plan = pipeline_plan
        self.gradient_scales = gradient_scales or GradientScaleSchedule(model)
        self.profiler = profiler or NullProfiler()
        self.autocast = autocast or contextlib.nullcontext
        self.carried_state: ModelState | None = None

    # ------------------------------------------------------------ helpers
    def effective_chunk_size(self, block_size: int) -> int | None:
        c = self.tbptt_chunk_size
        return c if 0 < c < block_size else None

    def _load_state(self, batch: SequenceBatch) -> ModelState:
        """The state this step starts from: carried or fresh. The batch's resets are applied
        by the forward, token by token."""
        state = self.carried_state if self.streaming else None
        if state is None or state.batch_size != batch.batch_size:
            return self.model.init_state(batch.batch_size)
        return state

    def _store_state(self, state: ModelState) -> None:
        if self.streaming:
            self.carried_state = state.detach_()

    def counted_targets(self, batch: SequenceBatch) -> float:
        """The targets of `batch` the model's head counts: the denominator of its mean loss
        and its weight in token-weighted accumulation."""
        return count_targets(batch.targets, self.model.config.language_head)

    def _forward_piece(self, piece: SequenceBatch, state: ModelState | None) -> torch.Tensor:
        """Hidden states of a piece (a TBPTT chunk, or the whole block) continuing `state`,
        with the piece's summary event and reset masks."""
        return self.model.forward_hidden(
            piece.inputs,
            state,
            summary_event_mask=piece.summary_event_mask,
            reset_mask=piece.reset_mask,
        )

    def _piece_loss(self, hidden, targets, normalizer: float) -> torch.Tensor:
        return self.model.loss_from_hidden(hidden, targets, reduction="sum") / normalizer

    # ------------------------------------------------------------ train
    def compute_gradients(
        self, batch: SequenceBatch, loss_scale: float = 1.0, normalizer: float | None = None
    ) -> StepOutput:
        """Forward and backward of one block; gradients of `loss_scale * mean loss` are ADDED
        to the parameters' .grad. No gradient-scale schedule is applied (see train_step).

        `normalizer` replaces the block's counted targets as the loss's denominator (a
        sharded run divides by the count over every data-parallel rank); the returned loss is
        then the loss sum over `normalizer`."""
        counted = self.counted_targets(batch)
        normalizer = max(counted, 1.0) if normalizer is None else normalizer
        self.profiler.begin_step()
        self.model.train()
        if self.pipeline_plan is not None:
            loss = self._pipeline_forward_backward(batch, normalizer, loss_scale)
        else:
            loss = self._tbptt_forward_backward(batch, normalizer, loss_scale)
        if self.profiler.detail:
            self._detail_probes(batch)
        profile = self.profiler.end_step()
        stats: dict[str, Any] = {}
        if profile is not None:
            stats["profile"] = profile
        return StepOutput(loss, counted, stats)

    def apply_gradient_scale_schedule(self) -> None:
        """Multiply gradients by this step's schedule, then advance the step counter."""
        self.gradient_scales.apply_(list(self.model.named_parameters()))

    def train_step(self, batch: SequenceBatch) -> StepOutput:
        """Fresh gradients of the mean loss, scaled by the schedule (which then advances)."""
        self.model.zero_grad(set_to_none=True)
        out = self.compute_gradients(batch)
        self.apply_gradient_scale_schedule()
        return out

    def _backward(self, loss: torch.Tensor, loss_scale: float) -> None:
        self.profiler.begin_backward()
        (loss * loss_scale).backward()
        self.profiler.end_backward()

    def _tbptt_forward_backward(self, batch, normalizer, loss_scale) -> torch.Tensor:
        chunk = self.effective_chunk_size(batch.block_size) or batch.block_size
        # A final state is only worth computing if a later chunk or step reads it.
        needs_state = self.streaming or chunk < batch.block_size
        state = self._load_state(batch) if needs_state else None
        starts = list(range(0, batch.block_size, chunk))
        total = torch.zeros((), dtype=torch.float64, device=batch.targets.device)
        window_loss: torch.Tensor | None = None
        for i, start in enumerate(starts):
            piece_batch = batch.time_slice(start, min(start + chunk, batch.block_size))
            self.profiler.begin_forward()
            with self.autocast():
                hidden = self._forward_piece(piece_batch, state)
                piece = self._piece_loss(hidden, piece_batch.targets, normalizer)
            self.profiler.end_forward()
            window_loss = piece if window_loss is None else window_loss + piece
            total += piece.detach().double()
            last = i == len(starts) - 1
            if last or (i + 1) % self.tbptt_backprop_chunks == 0:
                self._backward(window_loss, loss_scale)
                window_loss = None
                if not last:
                    assert state is not None  # several chunks: _load_state gave one
                    state.detach_()
        if state is not None:
            self._store_state(state)
        return total.float()

    def _pipeline_forward_backward(self, batch, normalizer, loss_scale) -> torch.Tensor:
        losses = self._pipeline_losses(batch, normalizer)
        loss = torch.stack(losses).sum()
        self._backward(loss, loss_scale)
        return loss.detach().float()

    def _pipeline_losses(self, batch: SequenceBatch, normalizer: float) -> list[torch.Tensor]:
        """Microbatches with fresh states, layer ranges run in the plan's forward order."""
        plan = self.pipeline_plan
        assert plan is not None
        ranges = split_microbatch_ranges(batch.batch_size, plan.microbatches)
        micro = [batch.rows(r.start, r.stop) for r in ranges]
        states = [self.model.init_state(len(r)) for r in ranges]
        activations: list[torch.Tensor | None] = [None] * len(ranges)
        self.profiler.begin_forward()
        with self.autocast():
            for event in plan.forward_events():
                mb = event.microbatch_id
                layers = plan.assignment(event.virtual_stage_id).layer_range
                activations[mb] = self.model.forward_hidden(
                    micro[mb].inputs,
                    states[mb],
                    layers=layers,
                    u=activations[mb],
                    summary_event_mask=micro[mb].summary_event_mask,
                    reset_mask=micro[mb].reset_mask,
                )
            losses = [
                self._piece_loss(activations[mb], micro[mb].targets, normalizer)
                for mb in range(len(ranges))
            ]
        self.profiler.end_forward()
        return losses

    # ------------------------------------------------------------ profiling
    def _detail_probes(self, batch: SequenceBatch) -> None:
        """Time extra passes on this batch through parts of the model (profile 'detail'):
        the embedding, the first layer, the whole model (forward, and forward+backward of a
        stand-in loss mean(tanh(h)^2)), and the head (logits -> loss, hidden -> loss).

        They change nothing the step computes: their gradients come back from
        torch.autograd.grad instead of landing in .grad, they run from fresh states (the
        carried state is neither read nor advanced), and the random generators are restored
        afterwards, so dropout inside a probe does not shift the training's draws. With TBPTT
        they cover one backward window (backprop_chunks chunks): the most the step holds.
        """
        profiler, model = self.profiler, self.model
        assert isinstance(profiler, StepProfiler)
        span = batch.block_size
        chunk = self.effective_chunk_size(span)
        if chunk is not None:
            span = min(span, chunk * self.tbptt_backprop_chunks)
        inputs, targets = batch.inputs[:, :span], batch.targets[:, :span]
        events = _columns(batch.summary_event_mask, 0, span)
        params = [p for p in model.parameters() if p.requires_grad]

        def backward(loss: torch.Tensor, *leaves: torch.Tensor) -> None:
            torch.autograd.grad(loss, [*params, *leaves], allow_unused=True)

        def activity(hidden: torch.Tensor) -> torch.Tensor:
            return torch.tanh(hidden.float()).pow(2).mean()

        device = inputs.device
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        first = range(1)
        with rng, self.autocast():
            with profiler.probe("embed"):
                backward(activity(model.embed_tokens(inputs)))
            with torch.no_grad():
                embedded = model.embed_tokens(inputs)
            with profiler.probe("first_layer_forward"):
                model.forward_hidden(inputs, layers=first, u=embedded, summary_event_mask=events)
            leaf = embedded.detach().requires_grad_()
            with profiler.probe("first_layer_forward_backward"):
                first_hidden = model.forward_hidden(
                    inputs, layers=first, u=leaf, summary_event_mask=events
                )
                backward(activity(first_hidden), leaf)
            with profiler.probe("model_forward"):
                hidden = model.forward_hidden(inputs, summary_event_mask=events).detach()
            if model.config.language_head.type == "token":  # the NCA head has no logits
                logits = model.logits_from_hidden(hidden).detach().requires_grad_()
                with profiler.probe("logits_loss"):
                    torch.autograd.grad(token_cross_entropy(logits, targets), [logits])
            leaf = hidden.requires_grad_()
            with profiler.probe("hidden_logits_loss"):
                backward(model.loss_from_hidden(leaf, targets), leaf)
            with profiler.probe("model_forward_backward"):
                backward(activity(model.forward_hidden(inputs, summary_event_mask=events)))

    # ------------------------------------------------------------ validation
    @torch.no_grad()
    def valid_step(self, batch: SequenceBatch) -> torch.Tensor:
        """Mean loss of a block from a fresh state; no graph, the carried state is untouched."""
        was_training = self.model.training
        self.model.eval()
        try:
            normalizer = max(self.counted_targets(batch), 1.0)
            if self.pipeline_plan is not None:
                return torch.stack(self._pipeline_losses(batch, normalizer)).sum().float()
            state = self.model.init_state(batch.batch_size)
            chunk = self.effective_chunk_size(batch.block_size) or batch.block_size
            total = torch.zeros((), dtype=torch.float64, device=batch.targets.device)
            for start in range(0, batch.block_size, chunk):
                piece = batch.time_slice(start, min(start + chunk, batch.block_size))
                with self.autocast():
                    hidden = self._forward_piece(piece, state)
                    total += self._piece_loss(hidden, piece.targets, normalizer)
            return total.float()
        finally:
            self.model.train(was_training)

    def eval_loss(self, batch: SequenceBatch) -> tuple[float, float]:
        counted = self.counted_targets(batch)
        return float(self.valid_step(batch)) * counted, counted

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The gradient-scale counter and the carried streaming state (tensors, or None)."""
        return {
            "gradient_scales": self.gradient_scales.state_dict(),
            "carried_state": None
            if self.carried_state is None
            else self.carried_state.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        try:
            self.gradient_scales.load_state_dict(sd["gradient_scales"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"train-step state has no valid 'gradient_scales': {exc}"
            ) from exc
        carried = sd.get("carried_state")
        if carried is None:
            self.carried_state = None
        else:
            batch = int(carried["position"].shape[0])
            device = next(self.model.parameters()).device
            self.carried_state = self.model.init_state(batch).load_state_dict(carried).to(device)
