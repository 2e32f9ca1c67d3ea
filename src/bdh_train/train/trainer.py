"""The training loop: composes data, model, train step, accumulator, optimizer, checkpoints.

Unit of work is the micro-step (one block through `compute_gradients`); `accumulation_steps`
of them make one optimizer step. Everything that decides the next micro-step (weights,
optimizer, loader cursor, carried state, the open accumulation window, RNGs, counters) is in
the checkpoint, so a run stopped anywhere — even mid-window — resumes bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from bdh_train.config import RunConfig, dump_toml, save_config
from bdh_train.data import RandomWindowLoader, StreamingDocumentLoader, eval_batches, load_splits
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.distributed.env import DistContext
from bdh_train.distributed.pipeline import PipelineRunner
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.distributed.reduce import all_reduce_accumulated
from bdh_train.errors import BDHTrainError, CheckpointError, ConfigError
from bdh_train.model import BDH, groups
from bdh_train.train import checkpoint as ckpt
from bdh_train.train.accumulate import WeightedGradientAccumulator, write_to_params
from bdh_train.train.metrics import MetricsLog, Progress, plot_losses
from bdh_train.train.profile import StepProfile, StepProfiler
from bdh_train.train.schedules import GradientScaleSchedule, learning_rate
from bdh_train.train.step import LanguageTrainModel

CONFIG_FILE = "config.toml"


class TrainingDiverged(BDHTrainError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient."""


@dataclass
class RunResult:
    step: int
    stopped_early: bool
    checkpoint: Path | None
    last_val_loss: float | None
    sample: str | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BDHTrainError(
            "training.device='cuda' but no CUDA device is available; use 'auto' or 'cpu'"
        )
    return torch.device(name)


def build_model(cfg: RunConfig, device: torch.device) -> BDH:
    torch.manual_seed(cfg.training.seed)
    return BDH(cfg.model).to(device)


def data_generators(cfg: RunConfig) -> dict[str, Callable[[int], Any]]:
    """Token generators for non-file sources (`data.source = "nca"`)."""
    from bdh_train.data.nca import nca_source

    return {"nca": lambda vocab_size: nca_source(cfg.data.nca, vocab_size)}


def init_weights_from(model: BDH, cfg: RunConfig, source: str) -> list[str]:
    """Load weights only (init_from): our checkpoints or an official .pt state_dict.

    Honors init_transfer: a preserved-fresh decoder/norm keeps its fresh init. Interface
    parameters whose shapes differ (e.g. another vocabulary) stay fresh; a mis-shaped
    backbone parameter is an error. Returns the names that were kept fresh.
    """
    from bdh_train.interop import load_official_checkpoint

    path = Path(source)
    if path.is_file() and path.suffix in (".pt", ".pth", ".bin"):
        weights = load_official_checkpoint(path, cfg.model.n_layer).state_dict()
    else:
        weights = ckpt.load_model_weights(ckpt.resolve_checkpoint(path))
    transfer = cfg.training.init_transfer
    surface = set(groups.interface_surface_params(model))
    fresh = set()
    if transfer.preserve_fresh_decoder:
        fresh.add("decoder")
    if transfer.preserve_fresh_norm:
        fresh |= set(groups.params_for_target(model, "normalization"))
    own = model.state_dict()
    update = {}
    for name, tensor in own.items():
        if name in fresh or name not in weights:
            fresh.add(name)
            continue
        if weights[name].shape != tensor.shape:
            if name in surface:
                fresh.add(name)
                continue
            raise CheckpointError(
                f"init_from {source}: backbone parameter {name} has shape "
                f"{list(weights[name].shape)}, the model needs {list(tensor.shape)}"
            )
        update[name] = weights[name]
    model.load_state_dict({**own, **update})
    return sorted(fresh)


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        resume: bool = False,
        dist_ctx: DistContext | None = None,
        stream: IO[str] | None = None,
    ):
        """Validate everything (config, data, checkpoint) before anything is written."""
        self.cfg = cfg.validate()
        self.run_dir = Path(run_dir)
        self.device = resolve_device(cfg.training.device)
        self.dist = dist_ctx or DistContext()
        if self.dist.active:
            self.device = self.dist.device(self.device.type)
        t = cfg.training
        self.accum_steps = t.accumulation_steps
        self.train_data, self.val_data = load_splits(
            cfg.data.source,
            cfg.model.vocab_size,
            t.block_size,
            cfg.data.val_fraction,
            generators=data_generators(cfg),
        )
        self.byte_level = cfg.model.vocab_size == 256 and not str(cfg.data.source).endswith(".bin")
        self.model = build_model(cfg, self.device)
        if t.compile:
            self.model.compile_layers()
        self.fresh_params: list[str] = []
        if cfg.checkpoint.init_from and not resume:
            self.fresh_params = init_weights_from(self.model, cfg, cfg.checkpoint.init_from)
        plan = None
        p = cfg.parallel
        if p.pipeline_stages > 1:
            plan = build_pipeline_plan(
                cfg.model.n_layer,
                p.pipeline_stages,
                p.virtual_stages_per_rank,
                p.microbatches,
                p.schedule,
            )
        self.pipeline: PipelineRunner | None = None
        if plan is not None and not p.emulate:
            if self.dist.world_size != p.pipeline_stages:
                raise ConfigError(
                    f"parallel.pipeline_stages={p.pipeline_stages} needs exactly that many "
                    f"processes (torchrun --nproc-per-node {p.pipeline_stages}), got "
                    f"{self.dist.world_size}; or set parallel.emulate=true to run the plan's "
                    "microbatches in one process"
                )
            self.pipeline = PipelineRunner(
                self.model,
                plan,
                self.dist.rank,
                tbptt_chunk_size=t.tbptt_chunk_size,
                persist_across_steps=t.streaming,
            )
            plan = None  # the runner executes it; the step object does not emulate it
        self.loader = self._make_loader()
        self.optimizer = self._make_optimizer()
        self.profiler = StepProfiler(self.device) if t.profile else None
        self.step_model = LanguageTrainModel(
            self.model,
            tbptt_chunk_size=t.tbptt_chunk_size,
            tbptt_backprop_chunks=t.tbptt_backprop_chunks,
            persist_across_steps=t.streaming,
            pipeline_plan=plan,
            gradient_scales=GradientScaleSchedule(
                self.model, t.module_lr_scales, t.init_transfer, t.max_steps
            ),
            profiler=self.profiler,
            autocast=self._autocast,
        )
        self.accumulator = WeightedGradientAccumulator(self.model, torch.float32)
        self.step = 0
        self.micro = 0
        self.tokens = 0
        self.skips = 0
        self.window_loss = 0.0
        self.window_count = 0.0
        self.window_profiles: list[StepProfile] = []
        self.elapsed = 0.0
        self.stop_requested = False
        self.resumed_from: Path | None = None
        if resume:
            self.resumed_from = ckpt.resolve_checkpoint(self.run_dir)
            self._load_checkpoint(self.resumed_from)
        main = self.dist.is_main
        self.progress = Progress(t.max_steps, self.step, stream, enabled=main)

    # ------------------------------------------------------------------ construction
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.training.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _make_loader(self) -> RandomWindowLoader | StreamingDocumentLoader:
        """Data-parallel ranks take their rows of the global batch; pipeline ranks all see it."""
        t = self.cfg.training
        rank, world = (
            (0, 1) if self.pipeline is not None else (self.dist.rank, self.dist.world_size)
        )
        if t.streaming:
            return StreamingDocumentLoader(
                self.train_data,
                t.block_size,
                t.batch_size,
                t.logical_block_size,
                t.seed,
                rank,
                world,
            )
        return RandomWindowLoader(
            self.train_data,
            t.block_size,
            t.batch_size,
            t.seed,
            rank,
            world,
            micro_per_step=self.accum_steps,
        )

    def _make_optimizer(self) -> torch.optim.AdamW:
        o = self.cfg.optimizer
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        param_groups = [{"params": decay, "weight_decay": o.weight_decay}]
        if no_decay:
            param_groups.append({"params": no_decay, "weight_decay": 0.0})
        return torch.optim.AdamW(param_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)

    def lr_at(self, step: int) -> float:
        o = self.cfg.optimizer
        return learning_rate(
            step, o.lr, o.warmup_steps, self.cfg.training.max_steps, o.schedule, o.min_lr
        )

    def request_stop(self) -> None:
        """Checkpoint at the next micro-step boundary and return (SIGTERM, preemption)."""
        self.stop_requested = True

    # ------------------------------------------------------------------ the loop
    def run(self, stop_after_micro_steps: int | None = None) -> RunResult:
        t = self.cfg.training
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / CONFIG_FILE)
        resume_step = self.step if self.resumed_from is not None else None
        self.metrics = MetricsLog(self.run_dir, resume_step, enabled=self.dist.is_main)
        if self.resumed_from is not None:
            self.progress.log(
                f"resumed from {self.resumed_from} at step {self.step}"
                f" (micro-step {self.micro} of {self.accum_steps})"
            )
        micro_done = 0
        last_val: float | None = None
        started = time.perf_counter() - self.elapsed
        last_log_time, last_log_tokens = time.perf_counter(), self.tokens
        checkpoint: Path | None = None
        while self.step < t.max_steps:
            if self.stop_requested or (
                stop_after_micro_steps is not None and micro_done >= stop_after_micro_steps
            ):
                self.elapsed = time.perf_counter() - started
                checkpoint = self.save_checkpoint()
                self.progress.log(
                    f"stopped at step {self.step} (+{self.micro} micro-steps); checkpoint "
                    f"{checkpoint}; continue with: bdh-train train --resume {self.run_dir}"
                )
                self.progress.close()
                return RunResult(self.step, True, checkpoint, last_val, None)
            self._micro_step()
            micro_done += 1
            if self.micro < self.accum_steps:
                continue
            row = self._optimizer_step()
            self.elapsed = time.perf_counter() - started
            log_row = None
            if t.log_every and (self.step % t.log_every == 0 or self.step == t.max_steps):
                now = time.perf_counter()
                row["tokens_per_s"] = (self.tokens - last_log_tokens) / max(
                    now - last_log_time, 1e-9
                )
                row["elapsed_s"] = self.elapsed
                last_log_time, last_log_tokens = now, self.tokens
                self.metrics.write(row)
                log_row = row
            self.progress.update(self.step, log_row)
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.max_steps):
                last_val = self.evaluate()
            if t.checkpoint_every and (
                self.step % t.checkpoint_every == 0 or self.step == t.max_steps
            ):
                checkpoint = self.save_checkpoint()
        self.progress.close()
        if self.profiler is not None:
            self.progress.log(self.profiler.summary())
        if self.dist.is_main and t.log_every:
            plot_losses(self.run_dir)
        sample = self.sample() if self.dist.is_main else None
        return RunResult(self.step, False, checkpoint, last_val, sample)

    def _micro_step(self) -> None:
        batch = self.loader.next_batch().to(self.device)
        self.model.zero_grad(set_to_none=True)
        self.model.set_quant_step(self.step)  # BitNet warm-up lambda follows the step
        if self.pipeline is not None:  # gradients come back already summed over the stages
            loss, counted = self.pipeline.train_step(batch), batch.counted_tokens()
        else:
            out = self.step_model.compute_gradients(batch)
            loss, counted = float(out.loss), out.counted
            if "profile" in out.stats:
                self.window_profiles.append(out.stats["profile"])
        self.accumulator.accumulate_mean(None, weight=counted)
        self.window_loss += loss * counted
        self.window_count += counted
        self.micro += 1

    def _optimizer_step(self) -> dict[str, Any]:
        """Close the window: reduce, schedule, clip, step (or skip a non-finite step)."""
        loss_sum, count = self.window_loss, self.window_count
        if self.dist.active and self.pipeline is None:
            result = self.accumulator.finish_sums()
            grads = all_reduce_accumulated(result, self.model.named_parameters())
            totals = torch.tensor([loss_sum, count], dtype=torch.float64)
            dist.all_reduce(totals)
            loss_sum, count = totals.tolist()
        else:
            grads = self.accumulator.finish_mean().gradients
        write_to_params(grads, self.model)
        self.step_model.apply_gradient_scale_schedule()
        clip = self.cfg.optimizer.grad_clip_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf))
        loss = loss_sum / max(count, 1.0)
        lr = self.lr_at(self.step)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.skips = 0
        else:
            self.skips += 1
            self.progress.log(
                f"step {self.step + 1}: non-finite loss {loss} or gradient norm "
                f"{grad_norm}; step skipped ({self.skips} in a row)"
            )
            if self.skips > self.cfg.training.max_consecutive_skips:
                raise TrainingDiverged(
                    f"{self.skips} consecutive steps had a non-finite loss or gradient "
                    f"(training.max_consecutive_skips = {self.cfg.training.max_consecutive_skips})"
                    f"; stopping. The last good checkpoint in {self.run_dir / ckpt.CHECKPOINTS} "
                    "is intact: lower optimizer.lr or set optimizer.grad_clip_norm and resume"
                )
        self.model.zero_grad(set_to_none=True)
        self.step += 1
        self.micro = 0
        self.tokens += int(count)
        self.window_loss = self.window_count = 0.0
        row = {
            "step": self.step,
            "tokens": self.tokens,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
        }
        if self.window_profiles:  # training.profile: this window's time and memory
            mib = 1024 * 1024
            p = self.window_profiles
            row |= {
                "forward_s": sum(x.forward_s for x in p),
                "backward_s": sum(x.backward_s for x in p),
                "mem_before_mib": p[0].memory_before / mib,
                "mem_after_forward_mib": max(x.memory_after_forward for x in p) / mib,
                "mem_after_backward_mib": p[-1].memory_after_backward / mib,
            }
            self.window_profiles = []
        return row

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> float | None:
        """Mean validation loss over counted tokens; bits per byte for byte-level data."""
        if self.val_data is None:
            return None
        t = self.cfg.training
        total, count = 0.0, 0.0
        for batch in eval_batches(self.val_data, t.block_size, t.batch_size, t.eval_steps):
            batch = batch.to(self.device)
            if self.pipeline is not None:
                loss_sum, n = self.pipeline.eval_loss(batch)
            else:
                n = batch.counted_tokens()
                loss_sum = float(self.step_model.valid_step(batch)) * n
            total += loss_sum
            count += n
        val_loss = total / max(count, 1.0)
        row: dict[str, Any] = {"step": self.step, "val_loss": val_loss}
        if self.byte_level:
            row["bits_per_byte"] = val_loss / math.log(2)
        self.metrics.write(row)
        self.progress.log(
            f"step {self.step:>6} | val_loss {val_loss:.4f}"
            + (f" | {row['bits_per_byte']:.3f} bits/byte" if self.byte_level else "")
        )
        return val_loss

    def sample(self, max_new_tokens: int = 200) -> str | None:
        if self.cfg.model.language_head.type != "token" or self.cfg.model.vocab_size != 256:
            return None
        source = self.val_data if self.val_data is not None else self.train_data
        prompt = torch.as_tensor(source.tokens[:32].astype("int64"), device=self.device)
        self.model.eval()
        out = self.model.generate(
            prompt,
            max_new_tokens,
            temperature=0.8,
            top_k=50,
            generator=torch.Generator(self.device).manual_seed(0),
        )
        self.model.train()
        tok = ByteTokenizer()
        text = tok.decode(out[32:].tolist())
        self.progress.log(
            f"--- sample (prompt: {tok.decode(out[:32].tolist())!r}) ---\n{text}\n---"
        )
        return text

    # ------------------------------------------------------------------ checkpoints
    def _rank_payload(self) -> dict[str, Any]:
        return {
            "rng": ckpt.capture_rng_state(),
            "train_step": self.step_model.state_dict(),
            "accumulator": self.accumulator.state_dict(),
        }

    def save_checkpoint(self, before_rename: Callable[[Path], None] | None = None) -> Path:
        payloads = [self._rank_payload()]
        if self.dist.active:
            payloads = [None] * self.dist.world_size
            dist.all_gather_object(payloads, self._rank_payload())
        path = None
        if self.dist.is_main:

            def write(directory: Path) -> None:
                ckpt.save_model(
                    self.model,
                    directory,
                    {
                        "bdh_config": json.dumps(self.cfg.model.to_dict()),
                        "step": str(self.step),
                    },
                )
                torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
                torch.save(payloads, directory / "ranks.pt")
                ckpt.write_json(
                    directory / "trainer.json",
                    {
                        "step": self.step,
                        "micro": self.micro,
                        "tokens": self.tokens,
                        "skips": self.skips,
                        "window_loss": self.window_loss,
                        "window_count": self.window_count,
                        "elapsed": self.elapsed,
                        "world_size": self.dist.world_size,
                    },
                )
                ckpt.write_json(directory / "loader.json", self.loader.state_dict())
                (directory / CONFIG_FILE).write_text(dump_toml(self.cfg))

            path = ckpt.save_checkpoint(
                self.run_dir,
                ckpt.checkpoint_name(self.step, self.micro),
                write,
                self.cfg.training.keep_checkpoints,
                before_rename,
            )
        self.dist.barrier()
        return path if path is not None else self.run_dir / ckpt.CHECKPOINTS

    def _load_checkpoint(self, directory: Path) -> None:
        state = ckpt.read_json(directory / "trainer.json")
        if state.get("world_size", 1) != self.dist.world_size:
            raise CheckpointError(
                f"checkpoint {directory} was written by {state.get('world_size')} processes; "
                f"resume it with the same number (now {self.dist.world_size})"
            )
        ckpt.load_into_model(self.model, ckpt.load_model_weights(directory), directory)
        try:
            self.optimizer.load_state_dict(ckpt.torch_load(directory / "optimizer.pt"))
            self.loader.load_state_dict(ckpt.read_json(directory / "loader.json"))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {directory} does not fit this run: {exc}") from exc
        payload = ckpt.torch_load(directory / "ranks.pt")[self.dist.rank]
        self.step_model.load_state_dict(payload["train_step"])
        if self.step_model.carried_state is not None:
            self.step_model.carried_state.to(self.device)
        self.accumulator.load_state_dict(payload["accumulator"])
        ckpt.restore_rng_state(payload["rng"])
        self.step, self.micro, self.tokens = state["step"], state["micro"], state["tokens"]
        self.skips = state["skips"]
        self.window_loss, self.window_count = state["window_loss"], state["window_count"]
        self.elapsed = state["elapsed"]
