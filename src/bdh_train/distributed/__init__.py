"""Running across processes: the torchrun process group, the pipeline planner (the
`[parallel]` config, layer partition and schedule timeline) and the pipeline runner on
`torch.distributed.pipelining`."""

from bdh_train.distributed.env import DistContext
from bdh_train.distributed.pipeline import BDHStage, PipelineRunner
from bdh_train.distributed.planner import (
    SCHEDULES,
    ParallelConfig,
    PipelinePlan,
    build_pipeline_plan,
    render_timeline,
)

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
