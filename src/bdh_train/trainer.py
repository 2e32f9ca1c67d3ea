"""The trainer: builds each component from its config section, then runs the loop.

The unit of work is the micro-step (one block through the step executor);
`accumulation_steps` of them make one optimizer step. Everything that decides the next
micro-step (weights, optimizer, loader cursor, carried state, the open accumulation window,
RNGs, counters) is in the checkpoint, so a run stopped anywhere — even mid-window — resumes
bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shlex
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist

from bdh_train.batch import SequenceBatch, StepOutput
from bdh_train.config import RunConfig, dump_toml, save_config
from bdh_train.data import RandomWindowLoader, StreamingCorpusLoader, StreamingDocumentLoader
from bdh_train.data.tokenizer import (
    BYTES,
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
)
from bdh_train.distributed import fsdp
from bdh_train.distributed.env import DistContext, pipeline_mesh
from bdh_train.distributed.planner import build_pipeline_plan
from bdh_train.errors import BDHTrainError, CheckpointError, ConfigError
from bdh_train.model import BDH
from bdh_train.model.bdh import compile_mode_for
from bdh_train.train import checkpoint as ckpt
from bdh_train.train.accumulate import WeightedGradientAccumulator, write_to_params
from bdh_train.train.allocator import configure_host_allocator
from bdh_train.train.evaluate import evaluate
from bdh_train.train.init_from import init_weights_from
from bdh_train.train.metrics import (
    PLOT_FILE,
    MetricsReporter,
    Progress,
    format_duration,
    plot_losses,
)
from bdh_train.train.profile import ProfileSettings, StepProfile, StepProfiler, profile_row
from bdh_train.train.reduce import accumulate_sharded, all_reduce_accumulated, all_reduce_sums
from bdh_train.train.run_dir import LOCK_FILE, RunDirLock, check_fresh_run_dir, clear_run_dir
from bdh_train.train.schedules import GradientScaleSchedule
from bdh_train.train.step import LanguageTrainModel, StepExecutor

CONFIG_FILE = "config.toml"
TRAINER_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"
LOADER_FILE = "loader.json"
RANKS_FILE = "ranks.pt"


class TrainingDiverged(BDHTrainError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient."""


@dataclass
class RunResult:
    step: int
    stopped_early: bool
    checkpoint: Path | None
    last_val_loss: float | None
    sample: str | None


def moved_tokenizer_override(run_dir: Path) -> list[str]:
    """`--set` overrides for resuming `run_dir` after it moved: [] or one that names the run's
    own tokenizer copy.

    A run's config.toml names its copy of a Hugging Face tokenizer by absolute path
    (`Trainer.saved_cfg`), so a run directory moved or copied elsewhere still names the old
    place. When that file no longer exists and this run directory holds its own copy, the
    copy is named instead (the checkpoint's fingerprint check still applies). Later
    overrides, the user's, still win; `bdh-train train --resume` applies it only when no
    --config file is given, since one may name the tokenizer."""
    try:
        named = tomllib.loads((run_dir / CONFIG_FILE).read_text())["data"]["tokenizer"]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return []  # loading the config reports what is wrong with it
    own_copy = run_dir / TOKENIZER_FILE
    if not isinstance(named, str) or named == BYTES or Path(named).name != TOKENIZER_FILE:
        return []
    if Path(named).exists() or not own_copy.is_file():
        return []
    # a TOML basic string: JSON's escapes are TOML's, except surrogate pairs (kept raw here)
    return [f"data.tokenizer={json.dumps(str(own_copy.resolve()), ensure_ascii=False)}"]


@dataclass
class TrainerState:
    """The loop's counters and the open window's loss sums, saved as trainer.json."""

    step: int = 0
    """Optimizer steps taken."""
    micro: int = 0
    """Micro-steps taken in the open accumulation window."""
    tokens: int = 0
    """Counted targets trained on, over all processes."""
    skips: int = 0
    """Consecutive optimizer steps skipped for a non-finite loss or gradient."""
    window_loss: float = 0.0
    window_count: float = 0.0
    elapsed: float = 0.0
    """Training seconds, summed over resumes."""
    world_size: int = 1

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        needed = ("step", "micro", "tokens", "skips", "window_loss", "window_count", "elapsed")
        if not isinstance(state, dict):
            raise ValueError(f"it holds a {type(state).__name__}, not the counters")
        missing = [name for name in needed if name not in state]
        if missing:  # the checkpointer names the file and the checkpoint
            raise ValueError(f"it lacks the counters {', '.join(missing)}")
        written_by = state.get("world_size", 1)
        if written_by != self.world_size and int(state["micro"]):
            raise CheckpointError(
                f"the checkpoint was taken {state['micro']} micro-step(s) into an accumulation "
                f"window by {written_by} processes; resume it with {written_by} processes (now "
                f"{self.world_size}), or resume another number from a checkpoint taken at a "
                "step boundary"
            )
        for name in ("step", "micro", "tokens", "skips"):
            setattr(self, name, int(state[name]))
        for name in ("window_loss", "window_count", "elapsed"):
            setattr(self, name, float(state[name]))


class RankStates:
    """The per-process parts of a checkpoint (RNGs, carried state, the open accumulation
    window and its loss sum and count, the gradient-scale counter), gathered from every rank
    into ranks.pt."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _own(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "rng": ckpt.capture_rng_state(),
            "train_step": t.executor.state_dict(),
            "accumulator": t.accumulator.state_dict(),
            "gradient_scales": t.gradient_scales.state_dict(),
            "window": [t.state.window_loss, t.state.window_count],
        }

    def state_dict(self) -> list[dict[str, Any]]:
        dist_ctx = self.trainer.dist
        if not dist_ctx.active:
            return [self._own()]
        payloads: list[Any] = [None] * dist_ctx.world_size
        dist.all_gather_object(payloads, self._own())
        return payloads

    def load_state_dict(self, payloads: list[dict[str, Any]]) -> None:
        t = self.trainer
        if len(payloads) == t.dist.world_size:
            payload = payloads[t.dist.rank]
        elif t.cfg.parallel.pipeline_stages > 1 and not t.cfg.parallel.emulate:
            raise CheckpointError(
                f"the checkpoint was written by {len(payloads)} processes of a pipeline mesh; "
                f"resume it with {len(payloads)} processes (now {t.dist.world_size})"
            )
        else:
            dp = t.data_parallel
            payload = regroup_rank_payloads(payloads, dp.rank, dp.world_size)
        t.executor.load_state_dict(payload["train_step"])
        t.accumulator.load_state_dict(payload["accumulator"])
        # Checkpoints of v0.1 kept the counter only inside the train-step state.
        scales = payload.get("gradient_scales") or payload["train_step"]["gradient_scales"]
        t.gradient_scales.load_state_dict(scales)
        ckpt.restore_rng_state(payload["rng"])
        # The open window's loss sum and count are this rank's own (trainer.json holds the
        # first process's); checkpoints before they were kept here fall back to those.
        if payload.get("window") is not None:
            t.state.window_loss, t.state.window_count = map(float, payload["window"])


def regroup_rank_payloads(
    payloads: list[dict[str, Any]], rank: int, world_size: int
) -> dict[str, Any]:
    """Rank `rank`'s part of a step-boundary checkpoint written by another number of
    data-parallel processes. The ranks' carried streaming states, in rank order, are the
    global batch's rows: they are joined and this rank takes its contiguous slice, as the
    loader deals its rows. The gradient-scale counter and the (empty) accumulation window are
    the same on every rank; the RNGs are those of the rank that held this rank's first row."""
    states = [p["train_step"].get("carried_state") for p in payloads]
    if any(s is None for s in states) and not all(s is None for s in states):
        raise CheckpointError("ranks.pt holds a carried state for some processes only")
    carried = None
    if states[0] is not None:  # the loader has checked that the rows split evenly
        per_rank = sum(int(s["position"].shape[0]) for s in states) // world_size
        lo = rank * per_rank
        carried = {
            key: torch.cat([s[key] for s in states])[lo : lo + per_rank].clone()
            for key in states[0]
        }
    first_row_owner = rank * len(payloads) // world_size
    return {
        "rng": payloads[first_row_owner]["rng"],
        "train_step": {**payloads[0]["train_step"], "carried_state": carried},
        "accumulator": payloads[0]["accumulator"],
        "gradient_scales": payloads[0].get("gradient_scales"),
        "window": None,  # a step-boundary checkpoint: the window is empty
    }


class ConfigText:
    """The resolved config, written beside the weights (save only)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def state_dict(self) -> str:
        return dump_toml(self.cfg)

    def load_state_dict(self, state: str) -> None:  # the CLI reads the config itself
        raise NotImplementedError


class TokenizerFile:
    """The run's Hugging Face tokenizer as a checkpoint part: its tokenizer.json text (save
    only; a resume reads the tokenizer from data.tokenizer)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer

    def state_dict(self) -> str:
        return self.tokenizer.to_json()

    def load_state_dict(self, state: str) -> None:
        raise NotImplementedError


SAMPLE_PROMPT_TOKENS = 32
"""The end-of-run sample continues this many tokens of the validation (else train) data."""


def sample_prompt(ids: np.ndarray, tokenizer: ByteTokenizer | HFTokenizer) -> np.ndarray:
    """The longest prefix of `ids` (at least one token) that decodes to whole UTF-8
    characters, so neither the prompt nor its continuation is printed with a character cut
    in two."""
    n = len(ids)
    while n > 1:
        try:
            tokenizer.decode_bytes(ids[:n]).decode("utf-8")
            break
        except UnicodeDecodeError:
            n -= 1
    return np.asarray(ids[:n], dtype=np.int64)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BDHTrainError(
            "training.device='cuda' but no CUDA device is available; use 'auto' or 'cpu'"
        )
    return torch.device(name)


def check_compiler(mode: str, device: torch.device) -> None:
    """Refuse a CPU compile where inductor finds no C++ compiler to build its kernels with,
    before the run starts, instead of failing inside its first step."""
    if device.type != "cpu" or compile_mode_for(mode, device) == "off":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch: inductor looks for its compiler itself
        return
    try:
        get_cpp_compiler()
    except Exception as e:  # inductor's InvalidCxxCompiler, or the search failing otherwise
        lines = str(e).strip().splitlines()
        reason = lines[0] if lines else type(e).__name__
        raise BDHTrainError(
            f"training.compile = {mode!r} builds C++ kernels on the CPU, but torch's inductor "
            f"found no C++ compiler ({reason}); install g++ (or point CXX at a compiler), or "
            "set training.compile = false"
        ) from e


def build_model(cfg: RunConfig, device: torch.device) -> BDH:
    """A freshly initialised model from the run's seed."""
    check_compiler(cfg.training.compile, device)
    torch.manual_seed(cfg.training.seed)
    model = BDH(cfg.model).to(device)
    model.set_recompute(cfg.training.recompute)
    model.compile_for_training(cfg.training.compile)
    return model


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        resume: bool = False,
        dist_ctx: DistContext | None = None,
        stream: IO[str] | None = None,
        overwrite: bool = False,
        resume_fallback: bool = False,
    ):
        """The main process takes the run directory's lock first: building a trainer already
        touches the directory (finishing or undoing an interrupted checkpoint save, reading
        the checkpoint), so a second trainer must be refused before it does. The lock is held
        until `run` ends or `close` is called, and released here when building fails."""
        dist = dist_ctx or DistContext()
        run_path = Path(run_dir)
        created = not run_path.exists()
        new_lock_file = not (run_path / LOCK_FILE).exists()
        self._lock = RunDirLock(run_path).acquire() if dist.is_main else None
        try:
            self._build(cfg, run_path, resume, dist, stream, overwrite, resume_fallback)
        except BaseException:
            self._release_lock()
            if dist.is_main and new_lock_file:  # a refused run leaves nothing of its own
                (run_path / LOCK_FILE).unlink(missing_ok=True)
                if created:
                    with contextlib.suppress(OSError):
                        run_path.rmdir()
            raise

    def close(self) -> None:
        """Let the run directory go without running (`run` does this when it ends)."""
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _build(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: bool,
        dist_ctx: DistContext,
        stream: IO[str] | None,
        overwrite: bool,
        resume_fallback: bool,
    ) -> None:
        """Validate everything (config, data, checkpoint, the run directory) before anything
        is written. A fresh run needs an empty run directory unless `overwrite`; a resume
        whose latest checkpoint is damaged continues from the newest intact one only with
        `resume_fallback`."""
        cfg = cfg.validate().resolved()
        t = cfg.training
        self.run_dir = Path(run_dir)
        self.tokenizer = cfg.data.load_tokenizer()
        self.tokenizer_named = cfg.data.tokenizer
        """data.tokenizer as given (the saved config names the run's copy instead)."""
        self.cfg = cfg
        self.saved_cfg = cfg
        """The config the run directory and its checkpoints store: `cfg`, naming the run's
        own copy of a Hugging Face tokenizer (written before the config)."""
        if isinstance(self.tokenizer, HFTokenizer):
            own_copy = str((self.run_dir / TOKENIZER_FILE).resolve())
            data = dataclasses.replace(cfg.data, tokenizer=own_copy)
            self.saved_cfg = dataclasses.replace(cfg, data=data)
        self.overwrite = overwrite and not resume
        self.dist = dist_ctx or DistContext()
        if not resume:
            check_fresh_run_dir(self.run_dir, overwrite)
            self.dist.barrier()  # every process has looked before the first one writes
        self.device = self.dist.device(resolve_device(t.device).type)
        if t.threads:
            torch.set_num_threads(t.threads)
        self.host_allocator = configure_host_allocator(
            t.host_allocator, self.device, saving_memory=t.recompute != "none"
        )
        self.accumulation_steps = t.accumulation_steps
        self.train_data, self.val_data = cfg.data.load_splits(cfg.model.vocab_size, t.block_size)
        self.model = build_model(cfg, self.device)
        self.fresh_params: list[str] = []
        if cfg.checkpoint.init_from and not resume:
            self.fresh_params = init_weights_from(
                self.model, t.init_transfer, cfg.checkpoint.init_from
            )
        if cfg.parallel.shard == "fsdp" and self.dist.active:
            fsdp.shard_model(self.model, self.dist, self.device.type)
        self.sharded = fsdp.is_sharded(self.model)
        """The parameters are FSDP shards (parallel.shard = 'fsdp' on several processes)."""
        self.gradient_scales = GradientScaleSchedule(
            self.model, t.gradient_scales, t.init_transfer, t.max_steps
        )
        self.profile_settings = ProfileSettings.resolve(t.profile, t.profile_memory)
        self.profiler = (
            StepProfiler(self.device, self.profile_settings)
            if self.profile_settings.enabled
            else None
        )
        self._window_started: float | None = None
        self.executor, self.data_parallel = self._build_executor()
        self.loader = self._build_loader()
        self.optimizer = cfg.optimizer.build(self.model)
        self.accumulator = WeightedGradientAccumulator(
            fsdp.local_parameters(self.model) if self.sharded else self.model, torch.float32
        )
        self.state = TrainerState(world_size=self.dist.world_size)
        self.checkpointer = ckpt.Checkpointer(self.run_dir, t.keep_checkpoints, self.dist.is_main)
        self.window_profiles: list[StepProfile] = []
        self.stop_requested = False
        self.metrics: MetricsReporter | None = None
        self.resumed_from = (
            ckpt.resolve_checkpoint(self.run_dir, fallback=resume_fallback) if resume else None
        )
        self.resume_notes: list[str] = []
        if self.resumed_from is not None:
            self._check_resumed_tokenizer(self.resumed_from)
            self._load_checkpoint(self.resumed_from)
            self.resume_notes = self._check_resumed_length(self.resumed_from)
        self.progress = Progress(
            t.max_steps,
            self.state.step,
            stream,
            enabled=self.dist.is_main,
            log_every=t.log_every,
            initial_tokens=self.state.tokens,
        )

    # ------------------------------------------------------------------ construction
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.training.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _build_executor(self) -> tuple[StepExecutor, DistContext]:
        """The step executor, and the data-parallel group its gradients are reduced over.
        The processes form a data_parallel x pipeline_stages mesh: a pipeline runner sums
        its gradients over its replica's stages, every stage of a replica sees the replica's
        rows, and the replicas reduce over the data-parallel dimension."""
        t, p = self.cfg.training, self.cfg.parallel
        replicas, stages = p.mesh_shape(self.dist.world_size)
        plan = None
        if p.pipeline_stages > 1:
            plan = build_pipeline_plan(
                self.cfg.model.n_layer,
                p.pipeline_stages,
                p.virtual_stages_per_rank,
                p.microbatches,
                p.schedule,
            )
        if plan is not None and stages > 1:
            from bdh_train.distributed.pipeline import PipelineRunner  # ~2 s of imports

            mesh = pipeline_mesh(self.dist, self.device.type, replicas, stages)
            return PipelineRunner(self.model, plan, mesh.stage, mesh.stage_group), mesh.data
        step = LanguageTrainModel(
            self.model,
            tbptt_chunk_size=t.tbptt_chunk_size,
            tbptt_backprop_chunks=t.tbptt_backprop_chunks,
            streaming=t.streaming,
            pipeline_plan=plan,
            gradient_scales=self.gradient_scales,
            profiler=self.profiler,
            autocast=self._autocast,
        )
        return step, self.dist

    def _build_loader(
        self,
    ) -> RandomWindowLoader | StreamingDocumentLoader | StreamingCorpusLoader:
        """Each data-parallel rank takes its rows of the global batch."""
        t, dp = self.cfg.training, self.data_parallel
        if t.stream_documents == "corpus":
            return StreamingCorpusLoader(
                self.train_data,
                t.block_size,
                t.batch_size,
                t.seed,
                dp.rank,
                dp.world_size,
                summary_trigger=self.cfg.data.summary_trigger(),
            )
        if t.streaming:
            return StreamingDocumentLoader(
                self.train_data,
                t.block_size,
                t.batch_size,
                t.logical_block_size,
                t.seed,
                dp.rank,
                dp.world_size,
                summary_trigger=self.cfg.data.summary_trigger(),
            )
        return RandomWindowLoader(
            self.train_data,
            t.block_size,
            t.batch_size,
            t.seed,
            dp.rank,
            dp.world_size,
            accumulation_steps=self.accumulation_steps,
            summary_trigger=self.cfg.data.summary_trigger(),
        )

    def _checkpoint_parts(
        self, loading: bool = False, sharded: bool = False
    ) -> dict[str, ckpt.Stateful]:
        """File -> stateful part; loaded in this order (trainer.json first: it checks the
        process count before anything else is touched). With `sharded` the model and the
        optimizer state go through DCP (`ckpt.ShardedState`); model.safetensors is then
        written as well, for generate, eval, export and init_from, but not loaded."""
        weights = ckpt.ModelWeights(
            self.model, self._model_metadata, partial(fsdp.full_weights, self.model)
        )
        parts: dict[str, ckpt.Stateful] = {
            TRAINER_FILE: self.state,
            ckpt.MODEL_FILE: weights,
            OPTIMIZER_FILE: self.optimizer,
            LOADER_FILE: self.loader,
            RANKS_FILE: RankStates(self),
        }
        if sharded:
            del parts[OPTIMIZER_FILE]
            if loading:
                del parts[ckpt.MODEL_FILE]
        if not loading:
            parts[CONFIG_FILE] = ConfigText(self.saved_cfg)
            if isinstance(self.tokenizer, HFTokenizer):
                parts[TOKENIZER_FILE] = TokenizerFile(self.tokenizer)
        return parts

    def _check_resumed_tokenizer(self, checkpoint: Path) -> None:
        """A resume continues with the tokenizer the checkpoint was trained with."""
        copy = checkpoint / TOKENIZER_FILE
        if not copy.is_file():
            return  # a byte run, or one written before runs carried their tokenizer
        if load_tokenizer(copy).fingerprint() != self.tokenizer.fingerprint():
            raise ConfigError(
                f"data.tokenizer '{self.tokenizer_named}' is not the tokenizer the checkpoint "
                f"{checkpoint} was trained with ({copy}): resume with data.tokenizer = '{copy}'"
            )

    def _load_checkpoint(self, checkpoint: Path) -> None:
        """A checkpoint with a sharded/ directory loads through DCP on any number of
        processes, sharded or not; a sharded model needs one."""
        sharded = (checkpoint / ckpt.SHARDED_DIR).is_dir()
        if self.sharded and not sharded:
            raise CheckpointError(
                f"checkpoint {checkpoint} was written by a run without parallel.shard='fsdp' "
                f"(it has no {ckpt.SHARDED_DIR}/ directory), which this sharded run cannot "
                "load; resume it with parallel.shard='none', or start the sharded run from its "
                "weights with checkpoint.init_from"
            )
        self.checkpointer.load(
            checkpoint,
            self._checkpoint_parts(loading=True, sharded=sharded),
            ckpt.ShardedState(self.model, self.optimizer) if sharded else None,
        )

    def _check_resumed_length(self, checkpoint: Path) -> list[str]:
        """Refuse a max_steps at or below the checkpoint's step (nothing would train); a
        warning line when max_steps differs from the checkpoint's, which re-stretches the
        learning-rate schedule (and any gradient-scale ramp) over the new length."""
        t, o, step = self.cfg.training, self.cfg.optimizer, self.state.step
        if t.max_steps <= step:
            raise ConfigError(
                f"training.max_steps = {t.max_steps} is at or below the checkpoint's step "
                f"{step}: there is nothing left to train; to train on, set a larger value "
                f"(e.g. --set training.max_steps={2 * step})"
            )
        try:
            saved = tomllib.loads((checkpoint / CONFIG_FILE).read_text(encoding="utf-8"))
            before = int(saved["training"]["max_steps"])
        except (OSError, ValueError, KeyError, TypeError, tomllib.TOMLDecodeError):
            return []  # no readable saved length: nothing to compare with
        if before == t.max_steps:
            return []
        old_lr, new_lr = o.lr_at(step, before), o.lr_at(step, t.max_steps)
        jump = (
            f"the lr at step {step} jumps from {old_lr:.3g} to {new_lr:.3g}"
            if old_lr != new_lr
            else f"the lr at step {step} stays {new_lr:.3g}"
        )
        return [
            f"warning: training.max_steps changed from {before} (the checkpoint's) to "
            f"{t.max_steps}: the {o.schedule} lr schedule is re-stretched over the new length; "
            f"{jump}"
        ]

    def _model_metadata(self) -> dict[str, str]:
        return {"bdh_config": json.dumps(self.cfg.model.to_dict()), "step": str(self.state.step)}

    def request_stop(self) -> None:
        """Checkpoint at the next micro-step boundary and return (SIGTERM, preemption)."""
        self.stop_requested = True

    # ------------------------------------------------------------------ the loop
    def run(self, stop_after_micro_steps: int | None = None) -> RunResult:
        """Train to `max_steps` (or until a stop is requested); the main process holds the
        run directory's lock throughout (taken when the trainer was built; again here for a
        second `run`), and releases it at the end."""
        if self._lock is None and self.dist.is_main:
            self._lock = RunDirLock(self.run_dir).acquire()
        failed = True
        try:
            result = self._run(stop_after_micro_steps)
            failed = False
            return result
        finally:
            if self.metrics is not None:
                self.metrics.close(failed)
            self._release_lock()

    def _run(self, stop_after_micro_steps: int | None) -> RunResult:
        t, s = self.cfg.training, self.state
        if self.dist.is_main:
            if self.overwrite:
                clear_run_dir(self.run_dir)
            self.tokenizer.save(self.run_dir)  # before the config that names this copy
            save_config(self.saved_cfg, self.run_dir / CONFIG_FILE)
        resume_step = s.step if self.resumed_from is not None else None
        self.metrics = MetricsReporter(
            self.run_dir,
            self.cfg.metrics,
            resume_step,
            enabled=self.dist.is_main,
            config=self.saved_cfg.to_dict(),
            config_text=dump_toml(self.saved_cfg),
        )
        for line in self.banner_lines():
            self.progress.log(line)
        for note in self.cfg.notes():
            self.progress.log(note)
        if self.resumed_from is not None:
            self.progress.log(
                f"resumed from {self.resumed_from} at step {s.step}"
                f" (micro-step {s.micro} of {self.accumulation_steps})"
            )
            for note in self.resume_notes:
                self.progress.log(note)
            if self.metrics.dropped_torn_line:
                self.progress.log(
                    f"notice: the last line of {self.metrics.path} was torn (an interrupted "
                    "write) and was dropped"
                )
        if self.profiler is not None:
            self.progress.log(self.profile_settings.describe())
        micro_done = 0
        last_val: float | None = None
        started = time.perf_counter() - s.elapsed
        last_log_time, last_log_tokens = time.perf_counter(), s.tokens
        checkpoint: Path | None = None
        compiling = t.compile != "off" and s.step < t.max_steps
        if compiling:
            self.progress.log(
                f"compiling the model (training.compile = {t.compile!r}): the first step takes "
                "longer…"
            )
        first_step_started = time.perf_counter()
        self.progress.restart_clock()
        while s.step < t.max_steps:
            if self._stop_agreed(
                self.stop_requested
                or (stop_after_micro_steps is not None and micro_done >= stop_after_micro_steps)
            ):
                s.elapsed = time.perf_counter() - started
                checkpoint = self.save_checkpoint()
                self.progress.log(
                    f"stopped at step {s.step} (+{s.micro} micro-steps); checkpoint "
                    f"{checkpoint}; continue with: bdh-train train --resume {self.run_dir}"
                )
                self.progress.close()
                return RunResult(s.step, True, checkpoint, last_val, None)
            self._micro_step()
            micro_done += 1
            if s.micro < self.accumulation_steps:
                continue
            row = self._optimizer_step()
            s.elapsed = time.perf_counter() - started
            if compiling:
                compiling = False
                took = time.perf_counter() - first_step_started
                self.progress.log(f"compiled: the first step took {took:.1f} s")
            if t.log_every and (s.step % t.log_every == 0 or s.step == t.max_steps):
                now = time.perf_counter()
                row["tokens_per_s"] = (s.tokens - last_log_tokens) / max(now - last_log_time, 1e-9)
                row["elapsed_s"] = s.elapsed
                last_log_time, last_log_tokens = now, s.tokens
                self.metrics.write(row)
            self.progress.update(s.step, row)
            if t.eval_every and (s.step % t.eval_every == 0 or s.step == t.max_steps):
                last_val = self.evaluate()
            # The final step always checkpoints, even with checkpoint_every = 0.
            due = s.step == t.max_steps or (t.checkpoint_every and s.step % t.checkpoint_every == 0)
            if due and s.skips == 0:  # never keep a step of a non-finite streak as "good"
                checkpoint = self.save_checkpoint()
        self.progress.close()
        if self.profiler is not None:
            self.progress.log(self.profiler.summary())
        if self.dist.is_main and t.log_every:
            plot_losses(self.run_dir)
        with fsdp.gathered(self.model):  # every rank gathers a sharded model's weights
            sample = self.sample() if self.dist.is_main else None
        result = RunResult(s.step, False, checkpoint, last_val, sample)
        for line in self.summary_lines(result):
            self.progress.log(line)
        return result

    # ------------------------------------------------------------------ console
    def banner_lines(self) -> list[str]:
        """What the run is about to do: run directory, device, parameters, data, tokens per
        optimizer step, steps, and the preset the config was layered on."""
        t, s = self.cfg.training, self.state
        params = sum(p.numel() for p in self.model.parameters())
        device = str(self.device)
        if self.dist.world_size > 1:
            replicas, stages = self.cfg.parallel.mesh_shape(self.dist.world_size)
            device += f" x {self.dist.world_size} processes"
            if stages > 1:
                device += f" ({replicas} data-parallel x {stages} pipeline stages)"
            if self.sharded:
                device += " (FSDP: parameters, gradients and optimizer state sharded)"
        val = f"{len(self.val_data):,} val tokens" if self.val_data is not None else "no val split"
        per_step = t.batch_size * t.block_size * self.accumulation_steps
        accum = f" x {self.accumulation_steps} micro-steps" if self.accumulation_steps > 1 else ""
        if self.resumed_from is not None:
            steps = f"steps {s.step} -> {t.max_steps} (resumed)"
        else:
            steps = f"{t.max_steps:,} steps"
        if self.cfg.layered_on is not None:
            layered = f"layered on {self.cfg.layered_on}"
        elif self.resumed_from is not None:
            layered = f"the run's saved {CONFIG_FILE}"
        else:
            layered = "built directly (no preset)"
        tokenizer = (
            [f"tokenizer      {self.tokenizer_named} ({self.tokenizer.vocab_size:,} ids)"]
            if isinstance(self.tokenizer, HFTokenizer)
            else []
        )
        return [
            f"run directory  {self.run_dir.resolve()}",
            f"device         {device}",
            f"model          {params / 1e6:.2f} M parameters ({params:,})",
            f"data           {self.cfg.data.source}: {len(self.train_data):,} train tokens, {val}",
            *tokenizer,
            f"per step       {t.batch_size} x {t.block_size} tokens{accum} = {per_step:,} tokens",
            f"length         {steps} ({t.max_steps * per_step:,} tokens in all)",
            f"config         {layered}",
        ]

    def summary_lines(self, result: RunResult) -> list[str]:
        """Where the run's results are and the commands that use them."""
        run_dir = self.run_dir.resolve()
        quoted = shlex.quote(str(run_dir))
        s, t = self.state, self.cfg.training
        rate = s.tokens / max(s.elapsed, 1e-9)
        val = f"; val_loss {result.last_val_loss:.4f}" if result.last_val_loss is not None else ""
        lines = [
            f"finished {result.step} steps, {s.tokens:,} tokens in {format_duration(s.elapsed)} "
            f"({rate:,.0f} tok/s){val}",
        ]
        if result.checkpoint is not None:
            lines.append(f"checkpoint     {result.checkpoint.resolve()}")
        plot = run_dir / PLOT_FILE
        if plot.is_file():
            lines.append(f"loss plot      {plot}")
        lines.append(
            f"train on       bdh-train train --resume {quoted} "
            f"--set training.max_steps={2 * t.max_steps}"
        )
        if self._writes_text(self.cfg.data.source):
            lines.append(f"generate       bdh-train generate --checkpoint {quoted} --prompt 'The '")
        lines.append(f"evaluate       bdh-train eval --checkpoint {quoted}")
        return lines

    def _stop_agreed(self, local: bool) -> bool:
        """Whether any process asked to stop: one MAX all-reduce of a flag per micro-step over
        every rank (data-parallel and pipeline alike), so a signal to any one rank stops them
        all at the same micro-step with one checkpoint. Free in one process."""
        if not self.dist.active:
            return local
        flag = torch.tensor([int(local)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _micro_step(self) -> None:
        s = self.state
        if self.profiler is not None and self._window_started is None:
            self._window_started = time.perf_counter()
        batch = self.loader.next_batch().to(self.device)
        self.model.zero_grad(set_to_none=True)
        self.model.set_quant_step(s.step)  # the BitNet warm-up lambda follows the step
        if self.sharded:
            out = self._sharded_gradients(batch)
        else:
            out = self.executor.compute_gradients(batch)
            self.accumulator.accumulate_mean(None, weight=out.counted)
            s.window_loss += float(out.loss) * out.counted
        if "profile" in out.stats:
            self.window_profiles.append(out.stats["profile"])
        s.window_count += out.counted
        s.micro += 1

    def _sharded_gradients(self, batch: SequenceBatch) -> StepOutput:
        """A sharded micro-batch (`accumulate_sharded`: the loss sum over the micro-batch's
        global count of targets, reduce-scattered in the backward)."""
        assert isinstance(self.executor, LanguageTrainModel)
        out, loss_sum = accumulate_sharded(
            self.executor, batch, self.accumulator, self.data_parallel.group
        )
        self.state.window_loss += loss_sum
        return out

    def _reduce_window(self) -> tuple[dict[str, torch.Tensor], float, float]:
        """The window's exact token-weighted gradients and (loss sum, count), over every
        data-parallel rank."""
        s = self.state
        if not self.data_parallel.active:
            return self.accumulator.finish_mean().gradients, s.window_loss, s.window_count
        group = self.data_parallel.group
        if self.sharded:  # the shards are already reduced (see _sharded_gradients)
            loss_sum, count = all_reduce_sums([s.window_loss, s.window_count], group)
            return self.accumulator.finish_mean().gradients, loss_sum, count
        grads = all_reduce_accumulated(
            self.accumulator.finish_sums(), self.model.named_parameters(), group
        )
        loss_sum, count = all_reduce_sums([s.window_loss, s.window_count], group)
        return grads, loss_sum, count

    def _optimizer_step(self) -> dict[str, Any]:
        """Close the window: reduce, schedule, clip, step (or skip a non-finite step)."""
        s, o = self.state, self.cfg.optimizer
        grads, loss_sum, count = self._reduce_window()
        if self.sharded:
            fsdp.write_local_gradients(grads, self.model)
        else:
            write_to_params(grads, self.model)
        self.gradient_scales.apply_(list(self.model.named_parameters()))
        params = [p for p in self.model.parameters() if p.grad is not None]
        # On shards, clip_grad_norm_ computes the global norm and clips every shard by it.
        grad_norm = fsdp.total_norm(torch.nn.utils.clip_grad_norm_(params, o.clip_norm()))
        loss = loss_sum / max(count, 1.0)
        lr = o.lr_at(s.step, self.cfg.training.max_steps)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            s.skips = 0
        else:
            self._skip_step(loss, grad_norm)
        self.model.zero_grad(set_to_none=True)
        s.step += 1
        s.micro = 0
        s.tokens += int(count)
        s.window_loss = s.window_count = 0.0
        row = {"step": s.step, "tokens": s.tokens, "loss": loss, "lr": lr, "grad_norm": grad_norm}
        if self.window_profiles:  # training.profile: this window's time and memory
            row |= profile_row(self.window_profiles)
            self.window_profiles = []
            if self._window_started is not None:  # the whole step: data, micro-steps, optimizer
                row["step_s"] = time.perf_counter() - self._window_started
        self._window_started = None
        return row

    def _skip_step(self, loss: float, grad_norm: float) -> None:
        s, limit = self.state, self.cfg.training.max_consecutive_skips
        s.skips += 1
        self.progress.log(
            f"step {s.step + 1}: non-finite loss {loss} or gradient norm {grad_norm}; step "
            f"skipped ({s.skips} in a row)"
        )
        if s.skips > limit:
            try:
                advice = (
                    f"the last good checkpoint, {ckpt.resolve_checkpoint(self.run_dir)}, is from "
                    "before the streak: lower optimizer.lr or set optimizer.grad_clip_norm and "
                    "resume"
                )
            except CheckpointError:
                advice = (
                    "no checkpoint was written before the streak: lower optimizer.lr or set "
                    "optimizer.grad_clip_norm and start again"
                )
            raise TrainingDiverged(
                f"{s.skips} consecutive steps had a non-finite loss or gradient "
                f"(training.max_consecutive_skips = {limit}); stopping; {advice}"
            )

    # ------------------------------------------------------------------ evaluation
    def _writes_text(self, source: str | None) -> bool:
        """Whether the model's samples are text of the run's tokenizer: a token head over the
        tokenizer's whole vocabulary, trained on text of it (`source`)."""
        model = self.cfg.model
        return (
            model.language_head.type == "token"
            and model.vocab_size == self.tokenizer.vocab_size
            and self.cfg.data.is_text_of_tokenizer(source)
        )

    def _text_tokenizer(self) -> ByteTokenizer | HFTokenizer | None:
        """The run's tokenizer when the validation data is its text, else None."""
        data = self.cfg.data
        return self.tokenizer if data.is_text_of_tokenizer(data.val_source) else None

    def evaluate(self) -> float | None:
        """Mean validation loss over counted tokens (and bits per byte for text data)."""
        if self.val_data is None:
            return None
        t = self.cfg.training
        text_of = self._text_tokenizer()
        dp = self.data_parallel  # pipeline ranks evaluate every batch together instead
        with fsdp.gathered(self.model):
            result = evaluate(
                self.executor,
                self.val_data,
                t.block_size,
                t.batch_size,
                t.eval_steps,
                self.device,
                self.cfg.data.summary_trigger(),
                byte_lengths=None if text_of is None else text_of.token_byte_lengths(),
                head=self.cfg.model.language_head,
                part=(dp.rank, dp.world_size),
                add_across_ranks=partial(all_reduce_sums, group=dp.group) if dp.active else None,
            )
        if self.metrics is not None:
            self.metrics.write({"step": self.state.step, **result.row()})
        bits = result.bits_per_byte
        self.progress.log(
            f"step {self.state.step:>6} | val_loss {result.val_loss:.4f}"
            + (f" | {bits:.3f} bits/byte" if bits is not None else "")
        )
        return result.val_loss

    def sample(self, max_new_tokens: int = 200) -> str | None:
        """Continue the first `SAMPLE_PROMPT_TOKENS` validation (else train) tokens, decoded
        with the run's tokenizer; only for a token head on text of that tokenizer."""
        data = self.cfg.data
        if self.val_data is not None:
            source, name = self.val_data, data.val_source
        else:
            source, name = self.train_data, data.source
        if not self._writes_text(name):
            return None
        tok = self.tokenizer
        prompt = torch.as_tensor(
            sample_prompt(source.tokens[:SAMPLE_PROMPT_TOKENS], tok), device=self.device
        )
        self.model.eval()
        out = self.model.generate(
            prompt,
            max_new_tokens,
            temperature=0.8,
            top_k=50,
            generator=torch.Generator(self.device).manual_seed(0),
            summary_events=self.cfg.data.summary_trigger(),
        )
        self.model.train()
        text = tok.decode(out[len(prompt) :].tolist())
        self.progress.log(
            f"--- sample (prompt: {tok.decode(out[: len(prompt)].tolist())!r}) ---\n{text}\n---"
        )
        return text

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, before_rename: Callable[[Path], None] | None = None) -> Path:
        s = self.state
        sharded = self.cfg.parallel.shard == "fsdp"
        path = self.checkpointer.save(
            ckpt.checkpoint_name(s.step, s.micro),
            self._checkpoint_parts(sharded=sharded),
            before_rename,
            ckpt.ShardedState(self.model, self.optimizer) if sharded else None,
        )
        self.dist.barrier()
        return path if path is not None else self.run_dir / ckpt.CHECKPOINTS
