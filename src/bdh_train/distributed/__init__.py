"""Running across processes: the torchrun process group, the `[parallel]` config and its
pipeline-shape rules, the pipeline planner (layer partition and schedule timeline), the
pipeline runner on `torch.distributed.pipelining` and FSDP2 sharding.

The public names below are imported on first use (PEP 562), so importing one submodule (the
`[parallel]` config, say) does not import the others: `BDHStage` and `PipelineRunner` alone
cost about two seconds of start-up that a run without a pipeline should not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bdh_train.utils import lazy_names

_LAZY = {
    "BDHStage": "bdh_train.distributed.pipeline",
    "DistContext": "bdh_train.distributed.env",
    "ParallelConfig": "bdh_train.distributed.config",
    "PipelinePlan": "bdh_train.distributed.planner",
    "PipelineRunner": "bdh_train.distributed.pipeline",
    "SCHEDULES": "bdh_train.distributed.config",
    "build_pipeline_plan": "bdh_train.distributed.planner",
    "render_timeline": "bdh_train.distributed.planner",
}
"""Public name -> the module that defines it."""

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


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


if TYPE_CHECKING:
    from bdh_train.distributed.config import SCHEDULES, ParallelConfig
    from bdh_train.distributed.env import DistContext
    from bdh_train.distributed.pipeline import BDHStage, PipelineRunner
    from bdh_train.distributed.planner import PipelinePlan, build_pipeline_plan, render_timeline
