"""The trainer: builds each component from its config section, then runs the loop.

The unit of work is the micro-step (one block through the step executor); `accumulation_steps`
of them make one optimizer step (`train/window.py`). Everything that decides the next
micro-step (weights, optimizer, loader cursor, carried state, the open accumulation window,
RNGs, counters) is in the checkpoint (`train/state.py`), so a run stopped anywhere, even
mid-window, resumes bit for bit. The components decide their own cadence (`metrics.should_log`,
`evaluator.should_evaluate`, `checkpoints.should_save`) up to the loop's end; what is printed is
`train/console.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO

import torch

from bdh_train.config import RunConfig, dump_toml, save_config
from bdh_train.data.tokenizer import HFTokenizer
from bdh_train.distributed import fsdp
from bdh_train.distributed.env import DistContext, resolve_device
from bdh_train.evals.measures import run_end_line
from bdh_train.shared.threads import set_threads
from bdh_train.storage.run_dir import RunDir
from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.allocator import configure_host_allocator
from bdh_train.train.build import (
    EvalRecipe,
    build_evaluator,
    build_executor,
    build_loader,
    build_model,
)
from bdh_train.train.console import (
    Banner,
    CompileNotice,
    Progress,
    RunData,
    RunStart,
    budget_line,
    device_line,
    eval_line,
    resume_lines,
    sample_lines,
    stop_line,
    summary_lines,
)
from bdh_train.train.evaluate import SAMPLE_TOKENS, Evaluator, end_of_run_samples, writes_text
from bdh_train.train.init_from import init_weights_from
from bdh_train.train.metrics import MetricsReporter
from bdh_train.train.profile import ProfileSettings, StepProfiler
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.state import (
    CheckpointParts,
    RankStates,
    TrainerState,
    TrainingCheckpoints,
    diverged_advice,
    model_metadata,
    saved_files,
)
from bdh_train.train.throughput import run_throughput
from bdh_train.train.window import StepWindow, TrainingDiverged, reduction_for
from bdh_train.utils import steps_cap

__all__ = ["RunResult", "Trainer", "TrainingDiverged"]


@dataclass
class RunResult:
    """How `Trainer.run` ended: the step reached, whether a stop request ended it early, the
    last checkpoint written, the last validation loss and the end-of-run sample."""

    step: int
    stopped_early: bool
    checkpoint: Path | None
    last_val_loss: float | None
    sample: str | None


class Trainer:
    """One training run: every component built from its config section (data, model,
    step executor, window, optimizer, checkpoints, metrics, evaluation), then `run` loops
    micro-steps to `training.max_steps` (`end`), or until a stop is requested."""

    end_sample_tokens = SAMPLE_TOKENS  # how many tokens each end-of-run sample continues by

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path | RunDir,
        resume: bool = False,
        dist_ctx: DistContext | None = None,
        stream: IO[str] | None = None,
        overwrite: bool = False,
        resume_fallback: bool = False,
        checkpoint: Path | None = None,
    ):
        """The main process locks the run directory before building touches it (finishing
        interrupted saves, reading the checkpoint); a fresh run (which may start from
        `checkpoint`'s exact state) needs a directory that holds no other run. The lock is held
        until `run` ends or `close`; a refused build gives the lock file back as it was."""
        self.dist = dist_ctx or DistContext()
        self.run_files = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.run_dir = self.run_files.path
        self.overwrite = overwrite and not resume
        # the main process's refusal is every process's, before the build's first collective
        self.dist.on_main(self.run_files.lock, resolve_device(cfg.training.device).type)
        try:
            self._build(cfg, resume, stream, overwrite, resume_fallback, checkpoint)
        except BaseException:
            self.run_files.unlock(refused=True)
            raise
        self.run_files.claim()

    def close(self) -> None:
        """Let the run directory go without running (`run` does this when it ends)."""
        self.run_files.unlock()

    # ------------------------------------------------------------------ construction
    def _build(
        self,
        cfg: RunConfig,
        resume: bool,
        stream: IO[str] | None,
        overwrite: bool,
        resume_fallback: bool,
        checkpoint: Path | None,
    ) -> None:
        """Validate everything (config, data, checkpoint) before anything is written; a damaged
        latest checkpoint is passed over for the newest intact one only with `resume_fallback`."""
        cfg = cfg.validate().resolved()
        t = self.training = cfg.training
        self.cfg = self.saved_cfg = cfg
        self.tokenizer = cfg.data.load_tokenizer()
        if isinstance(self.tokenizer, HFTokenizer):  # the saved config names the run's copy
            copy = str(self.run_files.tokenizer_copy.resolve())
            self.saved_cfg = replace(cfg, data=replace(cfg.data, tokenizer=copy))
        if resume:
            self.run_files.check_no_links()
        else:
            self.run_files.check_fresh(overwrite)
            self.dist.barrier()  # every process has looked before the first one writes
        self.device = self.dist.device(resolve_device(t.device).type)
        self.threads = set_threads(t.threads)
        self.host_allocator = configure_host_allocator(
            t.host_allocator, self.device, saving_memory=t.recompute != "none"
        )
        self.train_data, self.val_data = cfg.data.load_splits(cfg.model.vocab_size, t.block_size)
        self.model = build_model(
            cfg.model, t, self.device, cfg.parallel, self.dist.world_size, cfg.optimizer.name
        )
        init = cfg.checkpoint.init_from if not resume and checkpoint is None else ""
        # the parameters init_from left freshly initialised (none without init_from)
        self.fresh_params = init_weights_from(self.model, t.init_transfer, init) if init else []
        if cfg.parallel.shard == "fsdp" and self.dist.active:
            fsdp.shard_model(self.model, self.dist, self.device.type)
        self.sharded = fsdp.is_sharded(self.model)  # parallel.shard = 'fsdp', several processes
        self.gradient_scales = GradientScaleSchedule(
            self.model, t.gradient_scales, t.init_transfer, t.max_steps
        )
        profile = ProfileSettings.resolve(t.profile, t.profile_memory)
        self.profiler = StepProfiler.of(profile, self.device)
        self.executor, self.data_parallel = build_executor(
            self.model, t, cfg.parallel, self.dist, self.device, self.gradient_scales, self.profiler
        )
        self.loader = build_loader(t, cfg.data, self.train_data, self.data_parallel)
        self.optimizer = cfg.optimizer.build(self.model)
        self.accumulator = WeightedGradientAccumulator(
            fsdp.local_parameters(self.model) if self.sharded else self.model, torch.float32
        )
        self.state = TrainerState(world_size=self.dist.world_size)
        self.window = StepWindow(
            self.model,
            reduction_for(self.executor, self.accumulator, self.model, self.data_parallel),
            self.optimizer,
            self.gradient_scales,
            self.state,
            cfg.optimizer,
            t,
            log=lambda line: self.progress.log(line),
            last_good=partial(diverged_advice, self.run_files),
            timed=self.profiler is not None,
        )
        p = cfg.parallel
        ranks = RankStates(
            self.executor,
            self.accumulator,
            self.gradient_scales,
            self.state,
            self.dist,
            self.data_parallel,
            pipelined=p.pipeline_stages > 1 and not p.emulate,
        )
        parts = CheckpointParts(
            model=self.model,
            optimizer=self.optimizer,
            state=self.state,
            loader=self.loader,
            ranks=ranks,
            model_metadata=partial(model_metadata, cfg.model.to_dict(), self.state),
            saved=saved_files(dump_toml(self.saved_cfg), self.tokenizer),
        )
        self.checkpoints = TrainingCheckpoints(
            self.run_files, t, parts, is_main=self.dist.is_main, dcp=p.shard == "fsdp"
        )
        self.evaluator: Evaluator | None = None
        if self.val_data is not None:
            recipe = EvalRecipe(t, cfg.data, cfg.model, self.tokenizer)
            self.evaluator = build_evaluator(
                self.executor, self.val_data, recipe, self.device, t.eval_steps, self.data_parallel
            )
        self.stop_requested, self.clock = False, time.perf_counter  # the time budget's clock
        self.throughput = run_throughput(
            self.executor, self.train_data, t, cfg.data, self.device, self.data_parallel.world_size
        )
        self.metrics: MetricsReporter | None = None
        self.resumed_from, self.resume_notes = None, list[str]()
        if resume or checkpoint is not None:
            where, named = checkpoint or self.run_dir, cfg.data.tokenizer
            self.resumed_from, self.resume_notes = self.checkpoints.resume(
                where, resume_fallback, self.tokenizer, named, cfg.optimizer
            )
        s, main = self.state, self.dist.is_main
        # where `run` ends, checkpointed and evaluated as a run's end: max_steps, or the start
        # plus `steps_cap()` (the run keeps its length, schedule and saved config)
        self.end = t.max_steps if (cap := steps_cap()) is None else min(t.max_steps, s.step + cap)
        self.checkpoints.last_step = self.end
        if self.evaluator is not None:
            self.evaluator.last_step = self.end
        self.progress = Progress(self.end, s.step, stream, main, t.log_every, s.tokens)
        self.progress.fallback = self.run_files.log_error  # kept lines, once the console is gone

    def request_stop(self) -> None:
        """Checkpoint at the next micro-step boundary and return (SIGTERM, preemption)."""
        self.stop_requested = True

    # ------------------------------------------------------------------ the loop
    def run(self, stop_after_micro_steps: int | None = None) -> RunResult:
        """Train to `end` (or until a stop is requested); the main process holds the
        run directory's lock throughout (taken when the trainer was built; again here for a
        second `run`), and releases it at the end."""
        failed = True
        try:
            if self.dist.is_main:
                self.run_files.lock()
            result, failed = self._run(stop_after_micro_steps), False
            return result
        finally:
            if self.metrics is not None:
                self.metrics.close(failed)
            self.run_files.unlock()

    def _run(self, stop_after: int | None) -> RunResult:
        s, t = self.state, self.training
        metrics = self._start()
        micro_done, last_val, checkpoint = 0, None, None
        started, budget = self.clock() - s.elapsed, t.time_budget_s
        compile_notice = CompileNotice(t.compile, s.step < self.end, self.progress.log)
        self.progress.restart_clock()
        while s.step < self.end:
            # Any process asking to stop (a signal to one rank, a spent time budget) stops
            # them all at this micro-step with one checkpoint.
            asked = stop_after is not None and micro_done >= stop_after
            spent = bool(budget) and s.micro == 0 and s.elapsed >= budget
            if self.dist.any_of(self.stop_requested or asked or spent, self.device):
                s.elapsed = self.clock() - started
                return self._stop(last_val, budget_line(t.max_time, s.elapsed) if spent else None)
            self.window.micro_step(lambda: self.loader.next_batch().to(self.device))
            micro_done += 1
            if s.micro < t.accumulation_steps:
                continue
            row = self.window.optimizer_step()
            s.elapsed = self.clock() - started
            compile_notice.step_done()
            metrics.log_step(row, s.elapsed)
            self.progress.update(s.step, row)
            if self.evaluator is not None and self.evaluator.should_evaluate(s.step):
                last_val = self.evaluate()
            if self.checkpoints.should_save(s.step, s.skips):
                checkpoint = self.save_checkpoint()
        return self._finish(checkpoint, last_val)

    def _start(self) -> MetricsReporter:
        """Open the metrics (a resumed run's rows are checked first), write the run's
        tokenizer copy and config, print the banner."""
        t, s, cfg = self.training, self.state, self.saved_cfg
        resumed_at = s.step if self.resumed_from is not None else None
        metrics = partial(MetricsReporter, self.run_files, self.cfg.metrics, resumed_at)
        metrics = partial(metrics, config=cfg.to_dict(), config_text=dump_toml(cfg))
        self.metrics = metrics(enabled=False, log_every=t.log_every, last_step=self.end)

        def write() -> None:  # the main process's part; a refusal in it is every process's
            if self.overwrite:
                self.run_files.clear()
            if self.resumed_from is None:
                self.run_files.forget_failed_starts()
            self.metrics = metrics(log_every=t.log_every, last_step=self.end)
            self.tokenizer.save(self.run_dir)  # before the config that names this copy
            save_config(cfg, self.run_files.config)

        self.dist.on_main(write, self.device.type)
        self.metrics.restart_clock(s.tokens)
        self.metrics.mfu = self.progress.mfu = None if (f := self.throughput) is None else f.mfu
        lines = [*self.banner().lines(), *self.cfg.notes()]
        if self.resumed_from is not None:
            torn = self.metrics.path if self.metrics.dropped_torn_line else None
            k = self.training.accumulation_steps
            lines += resume_lines(self.resumed_from, s.step, s.micro, k, self.resume_notes, torn)
        for line in lines:
            self.progress.log(line)
        if self.profiler is not None:
            self.progress.log(self.profiler.settings.describe())
        return self.metrics

    def _stop(self, last_val: float | None, why: str | None = None) -> RunResult:
        s = self.state
        if why is not None:
            self.progress.log(why, keep=True)
        checkpoint = self.save_checkpoint()
        self.progress.stop(stop_line(s.step, s.micro, checkpoint, self.run_dir))
        return RunResult(s.step, True, checkpoint, last_val, None)

    def _finish(self, checkpoint: Path | None, last_val: float | None) -> RunResult:
        s, t, m = self.state, self.training, self.cfg.model
        self.progress.close()
        if self.profiler is not None:
            self.progress.log(self.profiler.summary())
        if t.log_every and self.metrics is not None:
            self.metrics.plot()
        with fsdp.gathered(self.model):  # every rank gathers a sharded model's weights
            sample = self.sample() if self.dist.is_main else None
            gain = self.state_gain() if self.dist.is_main else None
        if gain is not None:
            self.progress.log(gain)
        text = writes_text(m.language_head, m.vocab_size, self.tokenizer, self.cfg.data.source)
        plot = self.run_files.loss_plot
        for line in summary_lines(self.run_dir, s, last_val, checkpoint, plot, t.max_steps, text):
            self.progress.log(line)
        return RunResult(s.step, False, checkpoint, last_val, sample)

    def banner(self) -> Banner:
        """What the run is about to do."""
        cfg, world, fresh = self.cfg, self.dist.world_size, self.resumed_from is None
        mesh = cfg.parallel.mesh_shape(world) if world > 1 else (1, 1)
        splits = (self.train_data, self.val_data)
        saved, init = self.run_files.config.name, cfg.checkpoint.init_from if fresh else None
        return Banner(
            self.run_dir,
            device_line(self.device, world, mesh, self.sharded, self.training),
            sum(p.numel() for p in self.model.parameters()),
            self.training,
            RunData.of(cfg.data, self.tokenizer, splits, self.evaluator),
            RunStart(saved, None if fresh else self.state.step, cfg.layered_on, init),
            threads=self.threads.describe() if self.device.type == "cpu" else None,
            throughput=None if self.throughput is None else self.throughput.describe(),
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> float | None:
        """Mean validation loss over counted tokens (and bits per byte for text data)."""
        if self.evaluator is None:
            return None
        self.model.set_quant_step(self.state.step)  # the warm-up lambda its checkpoint loads
        with fsdp.gathered(self.model):
            result = self.evaluator.run()
        if self.metrics is not None:
            self.metrics.write({"step": self.state.step, **result.row()})
        self.progress.log(eval_line(self.state.step, result.val_loss, result.bits_per_byte))
        return result.val_loss

    def sample(self, max_new_tokens: int | None = None) -> str | None:
        """`end_of_run_samples` of `max_new_tokens` tokens (None: `end_sample_tokens`), printed;
        the first, or None when the model writes no text of the run's tokenizer."""
        n = self.end_sample_tokens if max_new_tokens is None else max_new_tokens
        cfg, splits = self.cfg, (self.train_data, self.val_data)
        out = end_of_run_samples(
            self.model, self.tokenizer, cfg.model, cfg.data, splits, self.device, n
        )
        if out is not None:
            self.progress.log(sample_lines(*out))
        return None if out is None else out[1][0][1]

    def state_gain(self) -> str | None:
        """The end-of-run line on what the model's state does (`run_end_line`: recall on
        MQAR, else the state gain on the validation split); None without one."""
        return run_end_line(self.model, self.val_data, self.cfg)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, before_rename: Callable[[Path], None] | None = None) -> Path:
        s = self.state
        path = self.checkpoints.save(s.step, s.micro, before_rename)
        self.dist.barrier()
        return path if path is not None else self.run_files.checkpoints
