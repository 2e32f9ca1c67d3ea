"""A training run launched in this process: join the torchrun process group (or run alone),
build the trainer, run it, and free the group while the interpreter is whole."""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import os
import signal
import sys
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from bdh_train.config import RunConfig
from bdh_train.distributed.env import DistContext, launch_world_size, resolve_device
from bdh_train.errors import BDHTrainError, ConfigError
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.run_dir import RUNS_ROOT, RunDir, run_of_checkpoint
from bdh_train.training.trainer import RunResult, Trainer
from bdh_train.utils import STEPS_CAP_ENV, in_process_group, steps_cap

StopHandler = Callable[[Callable[[], None]], AbstractContextManager[None]]
"""Given the trainer's `request_stop`, a context that calls it when the run is asked to stop
(the CLI's SIGTERM and Ctrl-C handlers)."""


@dataclass
class TrainPlan:
    """What `bdh-train train` does: a fresh run in `run`, or with `resume` the run continued,
    from `checkpoint` (a checkpoint, or a run directory: its latest; None: a resumed run's
    latest) whose saved config is `continued`'s."""

    run: RunDir
    resume: bool
    checkpoint: Path | None
    continued: RunDir | None
    """The run or checkpoint directory whose saved config a resume continues."""


def stamped_run_dir(root: Path, now: _dt.datetime) -> Path:
    """root/<date>-<time> of `now`, or the first of root/<date>-<time>-2, -3, ... that does not
    exist where a command of the same second took the name. The name is checked, not claimed:
    two commands that reach this at one instant can still pick the same one, and the second is
    then refused by the first's lock, leaving its run as it is (`RunDir.lock`)."""
    stamp = now.strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while os.path.lexists(path):  # a dangling link holds its name too
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def plan_train(run_dir: str | None, resume: str | None) -> TrainPlan:
    """`bdh-train train [--run-dir RUN_DIR] [--resume [RESUME]]`.

    Without --resume, a fresh run in RUN_DIR (default runs/<date>-<time>, `stamped_run_dir`,
    which each process of a torchrun launch would stamp from its own clock: there RUN_DIR is
    required). With --resume RESUME (a bare --resume: RUN_DIR), RESUME is a run directory (or
    its checkpoints/), continued from its latest checkpoint, or a checkpoint directory. A
    checkpoint continues the run it belongs to when it is that run's newest checkpoint;
    otherwise, or given a --run-dir of its own, it continues in that new run directory. So
    does a run directory's latest checkpoint given a --run-dir other than RESUME: RESUME is
    left as it is. Nothing is ever written inside a checkpoint."""
    if resume is None:
        processes = launch_world_size()
        if not run_dir and processes > 1:
            raise ConfigError(
                f"a launch of {processes} processes needs --run-dir: each process "
                "would name its own runs/<date>-<time> directory from its own clock; give "
                "every process the same --run-dir DIR"
            )
        if run_dir:
            return TrainPlan(RunDir(run_dir), False, None, None)
        stamped = stamped_run_dir(Path(RUNS_ROOT), _dt.datetime.now())
        return TrainPlan(RunDir(stamped, stamped=True), False, None, None)
    path = Path(resume or run_dir or "")
    if str(path) in ("", "."):
        raise ConfigError("--resume needs a run directory: --resume DIR or --run-dir DIR")
    if path.name == ckpt.CHECKPOINTS and RunDir(path.parent, fresh=False).config.is_file():
        path = path.parent  # RUN/checkpoints: the run, as generate and eval read it
    if not ckpt.is_checkpoint_dir(path):
        if not resume or run_dir is None or Path(run_dir).resolve() == path.resolve():
            return TrainPlan(RunDir(path, fresh=False), True, None, RunDir(path, fresh=False))
        # a branch: the Trainer resolves RESUME's latest (--resume-fallback applies); RESUME's
        # checkpoints stay
        return TrainPlan(RunDir(run_dir), False, path, RunDir(path, fresh=False))
    owner = run_of_checkpoint(path)
    if run_dir is not None and (owner is None or Path(run_dir).resolve() != owner.path.resolve()):
        return TrainPlan(RunDir(run_dir), False, path, RunDir(path, fresh=False))
    if owner is None:
        raise ConfigError(
            f"{path} is a checkpoint outside a run directory: continue it in a new run "
            f"directory with --run-dir NEW --resume {path}"
        )
    # a directory of checkpoints/ not named step-N is no checkpoint of the run's (none listed)
    listed = ckpt.list_checkpoints(owner.checkpoints)
    if not listed or listed[-1].resolve() != path.resolve():
        newest = f" ({listed[-1].name} is)" if listed else ""
        raise ConfigError(
            f"{path} is not the newest checkpoint of {owner.path}{newest}: resuming the run "
            f"from it would overwrite the later ones; continue it in a new run directory with "
            f"--run-dir NEW --resume {path}"
        )
    return TrainPlan(RunDir(owner.path, fresh=False), True, path, RunDir(path, fresh=False))


def _no_stop_handler(request_stop: Callable[[], None]) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def train(
    cfg: RunConfig,
    run: RunDir,
    resume: bool = False,
    overwrite: bool = False,
    resume_fallback: bool = False,
    stop_handler: StopHandler = _no_stop_handler,
    checkpoint: Path | None = None,
) -> RunResult:
    """Train `cfg` in `run` (a fresh run, or with `resume` the run continued; from
    `checkpoint` when given) on the process group torchrun describes in the environment, or
    alone."""
    note = steps_cap_note(cfg)
    device_type = resolve_device(cfg.training.device).type
    dist_ctx = DistContext.from_env(device_type, cfg.parallel.collective_timeout_s)
    if note and dist_ctx.is_main:
        print(note, file=sys.stderr)
    trainer = None
    try:
        trainer = Trainer(
            cfg,
            run,
            resume=resume,
            dist_ctx=dist_ctx,
            overwrite=overwrite,
            resume_fallback=resume_fallback,
            checkpoint=checkpoint,
        )
        with stop_handler(trainer.request_stop):
            return trainer.run()
    except BaseException as exc:
        error: BaseException = exc
        if dist_ctx.active and _collective_failure(exc):
            error = _unanswered(exc, dist_ctx, cfg.parallel.collective_timeout_s, run)
        if dist_ctx.active and isinstance(error, BDHTrainError):
            _ignore_sigterm()  # ending already: torchrun's SIGTERM would hide the exit status
        # the traceback's frames (Trainer.run's `self` among them) would keep the trainer
        # alive past the collection below; the messages keep their files and lines
        traceback.clear_frames(exc.__traceback__)
        if error is exc:
            raise
        raise error from None
    finally:
        # The trainer sits in reference cycles, and its wrapped model (DDP's reducer, FSDP,
        # pipeline stages) holds the process group: left to the cycle collector, gloo's
        # group could be freed during interpreter shutdown, where a torchrun rank once
        # aborted ("terminate called without an active exception"). Freed here, the group
        # goes while the interpreter is whole, then is destroyed. An accelerator's memory
        # held by the cycles is given back here too, to a caller that goes on (a notebook).
        # On the CPU without a process group there is nothing to order or give back, and a
        # full collection costs time in proportion to the heap of the process that called
        # train (0.4 s in a long-lived one).
        trainer = None
        if in_process_group() or device_type != "cpu":
            gc.collect()
        dist_ctx.close()


def steps_cap_note(cfg: RunConfig) -> str | None:
    """The line that says `steps_cap()` shortens this command (`Trainer`: it ends that many
    steps past where it starts, its evaluations read at most that many batches, and the run
    keeps its configured length); None when the cap is unset."""
    cap = steps_cap()
    if cap is None:
        return None
    return (
        f"note: {STEPS_CAP_ENV}={cap} in the environment: this command ends at most {cap} "
        f"steps past where it starts and evaluates at most {cap} batches (a smoke test); the "
        f"run keeps training.max_steps = {cfg.training.max_steps} and its schedule: resume it "
        "without the variable to train on"
    )


def _ignore_sigterm() -> None:
    """A process of a launch that ends with an error: torchrun sends SIGTERM to the others as
    soon as the first one exits, which would end them (exit -15) before they print their own
    `error:` line and exit 2 (the group is freed next, which does not wait on the others)."""
    with contextlib.suppress(ValueError):  # not the main thread: leave the handlers
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _collective_failure(exc: BaseException) -> bool:
    """A wait on the other processes that failed: torch.distributed's errors, and gloo's,
    which come as plain RuntimeErrors naming its sources."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def _unanswered(
    exc: BaseException, dist_ctx: DistContext, timeout_s: float, run: RunDir
) -> BDHTrainError:
    """The one-line error of a process whose collective failed: which processes did not
    answer (those that did not report through the store), what gloo said, the last
    checkpoint."""
    silent = dist_ctx.silent_ranks()
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
    else:
        who = "another process"
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    said = said.split("] ", 1)[-1]  # gloo's source location
    if "timed out" in said.lower():
        what = f"{who} did not answer within parallel.collective_timeout_s = {timeout_s:g} s"
    else:
        what = f"{who} left the run"
    kept = ckpt.list_checkpoints(run.checkpoints) if run.checkpoints.is_dir() else []
    last = (
        f"the last checkpoint is {kept[-1]} (continue with --resume {run.path})"
        if kept
        else "no checkpoint was written"
    )
    return BDHTrainError(f"{what} (stopped, hung or gone; rank {dist_ctx.rank}: {said}); {last}")
