"""Running across processes: the torchrun process group, the pipeline planner (the
`[parallel]` config, layer partition and schedule timeline), the pipeline runner on
`torch.distributed.pipelining` (`bdh_train.distributed.pipeline`, imported by whoever runs a
pipeline: the module costs about two seconds of start-up) and FSDP2 sharding."""

from bdh_train.distributed.env import DistContext
from bdh_train.distributed.planner import (
    SCHEDULES,
    ParallelConfig,
    PipelinePlan,
    build_pipeline_plan,
    render_timeline,
)

__all__ = [
    "SCHEDULES",
    "DistContext",
    "ParallelConfig",
    "PipelinePlan",
    "build_pipeline_plan",
    "render_timeline",
]
