"""Running across processes: the torchrun process group, the `[parallel]` config and its
pipeline-shape rules, the pipeline planner (layer partition and schedule timeline), the
pipeline runner on `torch.distributed.pipelining` and FSDP2 sharding. `BDHStage` and
`PipelineRunner` are imported on first use: their module costs about two seconds of start-up
that a run without a pipeline should not pay."""

from typing import Any

from bdh_train.distributed.config import SCHEDULES, ParallelConfig
from bdh_train.distributed.env import DistContext
from bdh_train.distributed.planner import PipelinePlan, build_pipeline_plan, render_timeline

__all__ = [
    "SCHEDULES",
    "BDHStage",
    "DistContext",
    "ParallelConfig",
    "PipelinePlan",
    "PipelineRunner",
    "build_pipeline_plan",
    "render_timeline",
]


def __getattr__(name: str) -> Any:
    if name in ("BDHStage", "PipelineRunner"):
        from bdh_train.distributed import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
