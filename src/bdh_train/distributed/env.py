"""The process group of a `torchrun` launch: who am I, how many are we, which device."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bdh_train.errors import BDHTrainError, ConfigError


def resolve_device(name: str) -> torch.device:
    """training.device (or --device): 'auto' is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BDHTrainError(
            "training.device='cuda' but no CUDA device is available; use 'auto' or 'cpu'"
        )
    return torch.device(name)


def launch_world_size() -> int:
    """The processes of the torchrun launch this process belongs to (WORLD_SIZE); 1 alone."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.strip().isdigit():
        raise ConfigError(
            f"WORLD_SIZE={value!r} in the environment is not a process count: torchrun sets it "
            "to a positive integer; unset it to run one process"
        )
    return int(value)


@dataclass
class DistContext:
    """A process's place in a group: the whole torchrun launch, or one dimension of the
    data x pipeline mesh (`group` is then that dimension's process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False
    group: dist.ProcessGroup | None = None
    """The group collectives of this context run on; None = every process."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, device_type: str, timeout_s: float = 300.0) -> DistContext:
        """Join the group torchrun describes in the environment (gloo on CPU, nccl on GPU);
        a collective waits `timeout_s` seconds for the others before failing."""
        world = launch_world_size()
        if world <= 1:
            return cls()
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        owns = False
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            owns = True
        return cls(rank, world, local_rank, owns)

    def device(self, device_type: str) -> torch.device:
        if device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def any_of(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` is true on any process: one MAX all-reduce over every process of
        the launch (free in one process)."""
        if not self.active:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def on_main(self, action: Callable[[], object], device_type: str) -> None:
        """Run `action` on the main process; a BDHTrainError or OSError (a directory it may
        not write) it raises is raised on every process (`share_refusal`)."""
        refusal = None
        if self.is_main:
            try:
                action()
            except (BDHTrainError, OSError) as exc:
                refusal = exc
        self.share_refusal(refusal, device_type)

    def share_refusal(self, refusal: BDHTrainError | OSError | None, device_type: str) -> None:
        """Raise the main process's refusal (None: none) on every process: one broadcast of
        its message, so that the others stop with the same error instead of waiting in the
        next collective for a process that is gone."""
        if self.active:
            message = [None if refusal is None else _one_line(refusal)]
            dist.broadcast_object_list(message, src=0, device=self.device(device_type))
            if message[0] is not None and refusal is None:
                raise BDHTrainError(message[0])
        if refusal is not None:
            raise refusal

    def silent_ranks(self, wait_s: float = 3.0) -> list[int] | None:
        """After a collective failed: the processes that did not say, through the launch's
        store, that they are still here within `wait_s` seconds (every process whose
        collective failed says so); None when the store cannot tell."""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=wait_s))
            store.set(f"bdh-train/alive/{self.rank}", "1")
            keys = [f"bdh-train/alive/{r}" for r in range(self.world_size)]
            deadline = time.monotonic() + wait_s
            while True:
                silent = [r for r, key in enumerate(keys) if not store.check([key])]
                if not silent or time.monotonic() >= deadline:
                    return silent
                time.sleep(0.1)
        except (RuntimeError, ValueError):
            return None

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class PipelineMesh:
    """This process's coordinates on the data_parallel x pipeline_stages mesh."""

    data: DistContext
    """The replicas: this process's replica index, their count and the group of the
    processes holding the same stage in every replica."""
    stage: int
    """This process's pipeline stage inside its replica."""
    stage_group: dist.ProcessGroup | None
    """The processes of this replica's pipeline; None when they are every process."""


def pipeline_mesh(world: DistContext, device_type: str, replicas: int, stages: int) -> PipelineMesh:
    """The ("dp", "pp") device mesh of `replicas` x `stages` processes, global rank =
    replica * stages + stage (torch's `init_device_mesh`)."""
    if replicas == 1:
        return PipelineMesh(DistContext(), world.rank, None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (replicas, stages), mesh_dim_names=("dp", "pp"))
    data = DistContext(
        mesh.get_local_rank("dp"), replicas, world.local_rank, group=mesh.get_group("dp")
    )
    return PipelineMesh(data, mesh.get_local_rank("pp"), mesh.get_group("pp"))


def _one_line(refusal: BaseException) -> str:
    """What the other processes raise for the main process's refusal: its message, or an
    OSError's reason and file."""
    if isinstance(refusal, OSError):
        where = f": {refusal.filename}" if refusal.filename else ""
        return f"the main process could not go on ({refusal.strerror or refusal}{where})"
    return str(refusal)
