"""What a training checkpoint holds and the rules for resuming from one.

A checkpoint of a run is a directory of stateful parts (`checkpoint.Checkpointer` writes them
atomically): trainer.json (`TrainerState`: the loop's counters), model.safetensors,
optimizer.pt, loader.json (the loader's cursor), ranks.pt (`RankStates`: each process's RNGs,
carried state, open accumulation window and gradient-scale counter), config.toml and, for a
Hugging Face tokenizer, tokenizer.json. With `parallel.shard = 'fsdp'` the model and optimizer
go to sharded/ through DCP instead (model.safetensors is still written, for inference).
`TrainingCheckpoints` assembles the parts, decides when one is due, saves and loads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bdh_train.data.tokenizer import TOKENIZER_FILE, HFTokenizer, Tokenizer, load_tokenizer
from bdh_train.distributed import fsdp
from bdh_train.distributed.env import DistContext
from bdh_train.errors import CheckpointError, ConfigError
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.dcp import ShardedState
from bdh_train.storage.run_dir import CONFIG_FILE, RunDir, read_saved_config
from bdh_train.train.config import TrainingConfig
from bdh_train.train.optim import OptimizerConfig, decay_start

TRAINER_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"
LOADER_FILE = "loader.json"
RANKS_FILE = "ranks.pt"


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


@dataclass
class RankStates:
    """The per-process parts of a checkpoint (RNGs, carried state, the open accumulation
    window and its loss sum and count, the gradient-scale counter), gathered from every rank
    into ranks.pt."""

    executor: ckpt.Stateful
    accumulator: ckpt.Stateful
    gradient_scales: ckpt.Stateful
    state: TrainerState
    dist: DistContext
    """Every process of the run."""
    data_parallel: DistContext
    """The data-parallel dimension a checkpoint's rows are dealt over."""
    pipelined: bool
    """The processes form a pipeline mesh (whose ranks' states cannot be regrouped)."""

    def _own(self) -> dict[str, Any]:
        return {
            "rng": ckpt.capture_rng_state(),
            "train_step": self.executor.state_dict(),
            "accumulator": self.accumulator.state_dict(),
            "gradient_scales": self.gradient_scales.state_dict(),
            "window": [self.state.window_loss, self.state.window_count],
        }

    def state_dict(self) -> list[dict[str, Any]]:
        if not self.dist.active:
            return [self._own()]
        payloads: list[Any] = [None] * self.dist.world_size
        dist.all_gather_object(payloads, self._own())
        return payloads

    def load_state_dict(self, payloads: list[dict[str, Any]]) -> None:
        if len(payloads) == self.dist.world_size:
            payload = payloads[self.dist.rank]
        elif self.pipelined:
            raise CheckpointError(
                f"the checkpoint was written by {len(payloads)} processes of a pipeline mesh; "
                f"resume it with {len(payloads)} processes (now {self.dist.world_size})"
            )
        else:
            dp = self.data_parallel
            payload = regroup_rank_payloads(payloads, dp.rank, dp.world_size)
        self.executor.load_state_dict(payload["train_step"])
        self.accumulator.load_state_dict(payload["accumulator"])
        # Checkpoints of v0.1 kept the counter only inside the train-step state.
        scales = payload.get("gradient_scales") or payload["train_step"]["gradient_scales"]
        self.gradient_scales.load_state_dict(scales)
        ckpt.restore_rng_state(payload["rng"])
        # The open window's loss sum and count are this rank's own (trainer.json holds the
        # first process's); checkpoints before they were kept here fall back to those.
        if payload.get("window") is not None:
            self.state.window_loss, self.state.window_count = map(float, payload["window"])


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


@dataclass
class SavedText:
    """A text file of the checkpoint that is written but never loaded: the resolved config
    (a resume reads the config itself) or the tokenizer's JSON (a resume reads
    data.tokenizer)."""

    text: str

    def state_dict(self) -> str:
        return self.text

    def load_state_dict(self, state: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class CheckpointParts:
    """What a training checkpoint is made of (`TrainingCheckpoints`), named at construction."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainerState
    loader: ckpt.Stateful
    ranks: RankStates
    model_metadata: Callable[[], dict[str, str]]
    """model.safetensors' metadata at the time of a save (`model_metadata`)."""
    saved: dict[str, str]
    """The text files written beside the parts (config.toml, tokenizer.json: `saved_files`)."""


class TrainingCheckpoints:
    """The trainer's checkpoints: the parts, when one is due (every
    `training.checkpoint_every` steps and at the last, never inside a streak of skipped
    steps), saving them and loading them back."""

    def __init__(
        self,
        run: RunDir,
        training: TrainingConfig,
        parts: CheckpointParts,
        *,
        is_main: bool,
        dcp: bool,
    ) -> None:
        """`dcp` writes the model and optimizer as DCP shards (parallel.shard = 'fsdp'); only
        the main process (`is_main`) writes the files and recovers what a crash left."""
        self.run, self.training = run, training
        self.every, self.last_step = training.checkpoint_every, training.max_steps
        self.checkpointer = ckpt.Checkpointer(run.path, training.keep_checkpoints, is_main)
        self.dcp, self.model, self.optimizer = dcp, parts.model, parts.optimizer
        self.state, self.loader, self.ranks = parts.state, parts.loader, parts.ranks
        self.saved = parts.saved
        self.weights = ckpt.ModelWeights(
            parts.model, parts.model_metadata, partial(fsdp.full_weights, parts.model)
        )

    def should_save(self, step: int, skips: int) -> bool:
        """The final step always checkpoints, even with checkpoint_every = 0; a step of a
        non-finite streak is never kept as "good"."""
        due = step == self.last_step or (self.every and step % self.every == 0)
        return bool(due) and skips == 0

    def _parts(self, loading: bool, dcp: bool) -> dict[str, ckpt.Stateful]:
        """File -> stateful part; loaded in this order (trainer.json first: it checks the
        process count before anything else is touched). With `dcp` the model and the
        optimizer state go through DCP (`dcp.ShardedState`); model.safetensors is then
        written as well, for generate, eval, export and init_from, but not loaded."""
        parts: dict[str, ckpt.Stateful] = {
            TRAINER_FILE: self.state,
            ckpt.MODEL_FILE: self.weights,
            OPTIMIZER_FILE: self.optimizer,
            LOADER_FILE: self.loader,
            RANKS_FILE: self.ranks,
        }
        if dcp:
            del parts[OPTIMIZER_FILE]
            if loading:
                del parts[ckpt.MODEL_FILE]
        if not loading:
            parts |= {file: SavedText(text) for file, text in self.saved.items()}
        return parts

    def _sharded(self, dcp: bool) -> ShardedState | None:
        return ShardedState(self.model, self.optimizer) if dcp else None

    def save(
        self, step: int, micro: int, before_rename: Callable[[Path], None] | None = None
    ) -> Path | None:
        """Write checkpoint step-N[-mM] (every process takes part; the main one returns its
        path), after checking the run directory is still this run's."""
        self.run.check_owned()
        return self.checkpointer.save(
            ckpt.checkpoint_name(step, micro),
            self._parts(loading=False, dcp=self.dcp),
            before_rename,
            self._sharded(self.dcp),
        )

    def resume(
        self,
        where: Path,
        fallback: bool,
        tokenizer: Tokenizer,
        named: str,
        optimizer: OptimizerConfig,
    ) -> tuple[Path, list[str]]:
        """Load the checkpoint `where` names (a run directory's latest, or a checkpoint;
        `ckpt.resolve_checkpoint` with `fallback`) for a resume, after checking it was trained
        with `tokenizer` (data.tokenizer `named`); refused when nothing is left to train. The
        checkpoint and the resume's warnings."""
        checkpoint = ckpt.resolve_checkpoint(where, fallback=fallback)
        check_resumed_tokenizer(checkpoint, tokenizer, named)
        check_resumed_optimizer(checkpoint, optimizer)
        self.load(checkpoint)
        s = self.state
        return checkpoint, check_resumed_length(
            checkpoint, self.training, optimizer, s.step, s.elapsed
        )

    def load(self, checkpoint: Path) -> None:
        """A checkpoint with a sharded/ directory loads through DCP on any number of
        processes, sharded or not; a sharded model needs one."""
        dcp = (checkpoint / ckpt.SHARDED_DIR).is_dir()
        if fsdp.is_sharded(self.model) and not dcp:
            raise CheckpointError(
                f"checkpoint {checkpoint} was written by a run without parallel.shard='fsdp' "
                f"(it has no {ckpt.SHARDED_DIR}/ directory), which this sharded run cannot "
                "load; resume it with parallel.shard='none', or start the sharded run from its "
                "weights with checkpoint.init_from"
            )
        self.checkpointer.load(checkpoint, self._parts(loading=True, dcp=dcp), self._sharded(dcp))


def saved_files(config_text: str, tokenizer: Tokenizer) -> dict[str, str]:
    """The text files a checkpoint carries beside its parts: config.toml, and tokenizer.json
    for a Hugging Face tokenizer."""
    files = {CONFIG_FILE: config_text}
    if isinstance(tokenizer, HFTokenizer):
        files[TOKENIZER_FILE] = tokenizer.to_json()
    return files


def check_resumed_tokenizer(checkpoint: Path, tokenizer: Tokenizer, named: str) -> None:
    """A resume continues with the tokenizer the checkpoint was trained with (`named`:
    data.tokenizer as given)."""
    copy = checkpoint / TOKENIZER_FILE
    if not copy.is_file():
        return  # a byte run, or one written before runs carried their tokenizer
    if load_tokenizer(copy).fingerprint() != tokenizer.fingerprint():
        raise ConfigError(
            f"data.tokenizer '{named}' is not the tokenizer the checkpoint "
            f"{checkpoint} was trained with ({copy}): resume with data.tokenizer = '{copy}'"
        )


def check_resumed_optimizer(checkpoint: Path, optimizer: OptimizerConfig) -> None:
    """A resume continues with the optimizer whose state the checkpoint holds (a config saved
    before optimizer.name existed was AdamW's)."""
    try:
        saved = read_saved_config(checkpoint)
        before = saved.get("optimizer", {}).get("name", "adamw")
    except (OSError, ConfigError, ValueError, AttributeError):
        return  # no readable saved config: loading the state itself checks what it can
    if before != optimizer.name:
        raise ConfigError(
            f"optimizer.name = {optimizer.name!r}, but the checkpoint {checkpoint} holds the "
            f"state of {before!r}, which does not carry over: resume with "
            f"optimizer.name = {before!r}, or start a new run from its weights with "
            "checkpoint.init_from"
        )


def check_resumed_length(
    checkpoint: Path,
    training: TrainingConfig,
    optimizer: OptimizerConfig,
    step: int,
    state_elapsed: float = 0.0,
) -> list[str]:
    """Refuse a max_steps at or below the checkpoint's step, or a max_time the checkpoint's
    training time (`state_elapsed`) has spent (nothing would train); a
    warning line when max_steps differs from the checkpoint's, which re-stretches the
    learning-rate schedule (and any gradient-scale ramp) over the new length."""
    t, o = training, optimizer
    if t.time_budget_s and state_elapsed >= t.time_budget_s:
        raise ConfigError(
            f"training.max_time = {t.max_time!r} is spent: the checkpoint {checkpoint} has "
            f"trained for {state_elapsed:.0f} s; to train on, set a larger budget or 0 (none), "
            f"e.g. --set training.max_time={2 * t.time_budget_s:.0f}"
        )
    if t.max_steps <= step:
        raise ConfigError(
            f"training.max_steps = {t.max_steps} is at or below the checkpoint's step "
            f"{step}: there is nothing left to train; to train on, set a larger value "
            f"(e.g. --set training.max_steps={2 * step})"
        )
    try:
        saved = read_saved_config(checkpoint)
        before = int(saved["training"]["max_steps"])
    except (OSError, ConfigError, ValueError, KeyError, TypeError):
        return []  # no readable saved length: nothing to compare with
    if before == t.max_steps:
        return []
    old_lr, new_lr = o.lr_at(step, before), o.lr_at(step, t.max_steps)
    jump = (
        f"the lr at step {step} jumps from {old_lr:.3g} to {new_lr:.3g}"
        if old_lr != new_lr
        else f"the lr at step {step} stays {new_lr:.3g}"
    )
    if o.schedule == "wsd":
        start = decay_start(o.warmup_steps, t.max_steps, o.decay_fraction)
        stretch = f"the wsd decay now starts at step {start}"
    else:
        stretch = f"the {o.schedule} lr schedule is re-stretched over the new length"
    return [
        f"warning: training.max_steps changed from {before} (the checkpoint's) to "
        f"{t.max_steps}: {stretch}; {jump}"
    ]


def model_metadata(model_config: dict[str, Any], state: TrainerState) -> dict[str, str]:
    """model.safetensors' metadata (`checkpoint.weights_metadata`) at the state's step."""
    return ckpt.weights_metadata(model_config, state.step)


def diverged_advice(run: RunDir) -> str:
    """What to do after a run diverged: where the last good checkpoint is, if any."""
    try:
        last = ckpt.resolve_checkpoint(run.path)
    except CheckpointError:
        return (
            "no checkpoint was written before the streak: lower optimizer.lr or set "
            "optimizer.grad_clip_norm and start again"
        )
    return (
        f"the last good checkpoint, {last}, is from before the streak: lower optimizer.lr or "
        "set optimizer.grad_clip_norm and resume"
    )
