"""A training run launched in this process: join the torchrun process group (or run alone),
build the trainer, run it, and free the group while the interpreter is whole."""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager

from bdh_train.config import RunConfig
from bdh_train.distributed.env import DistContext, resolve_device
from bdh_train.train.run_dir import RunDir
from bdh_train.trainer import RunResult, Trainer

StopHandler = Callable[[Callable[[], None]], AbstractContextManager[None]]
"""Given the trainer's `request_stop`, a context that calls it when the run is asked to stop
(the CLI's SIGTERM and Ctrl-C handlers)."""


def _no_stop_handler(request_stop: Callable[[], None]) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def train(
    cfg: RunConfig,
    run: RunDir,
    resume: bool = False,
    overwrite: bool = False,
    resume_fallback: bool = False,
    stop_handler: StopHandler = _no_stop_handler,
) -> RunResult:
    """Train `cfg` in `run` (a fresh run, or with `resume` the run continued) on the process
    group torchrun describes in the environment, or alone."""
    dist_ctx = DistContext.from_env(
        resolve_device(cfg.training.device).type, cfg.parallel.collective_timeout_s
    )
    trainer = None
    try:
        trainer = Trainer(
            cfg,
            run,
            resume=resume,
            dist_ctx=dist_ctx,
            overwrite=overwrite,
            resume_fallback=resume_fallback,
        )
        with stop_handler(trainer.request_stop):
            return trainer.run()
    except BaseException as exc:
        # the traceback's frames (Trainer.run's `self` among them) would keep the trainer
        # alive past the collection below; the messages keep their files and lines
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        # The trainer sits in reference cycles, and its wrapped model (DDP's reducer, FSDP,
        # pipeline stages) holds the process group: left to the cycle collector, gloo's
        # group could be freed during interpreter shutdown, where a torchrun rank once
        # aborted ("terminate called without an active exception"). Freed here, the group
        # goes while the interpreter is whole, then is destroyed.
        trainer = None
        gc.collect()
        dist_ctx.close()
