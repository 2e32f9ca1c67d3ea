"""Training components: the train step, exact weighted accumulation and its cross-rank
reduction, schedules, the optimizer, checkpoints, evaluation, metrics and profiling. Each
owns its config section where it has one; `bdh_train.training.trainer` assembles them.

The public names below are imported on first use (PEP 562), so importing one submodule
(`bdh_train.storage.checkpoint`, say) does not import its siblings and, through them,
`bdh_train.distributed`.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from bdh_train.utils import lazy_names

_LAZY = {
    "CheckpointConfig": "bdh_train.storage.checkpoint",
    "Checkpointer": "bdh_train.storage.checkpoint",
    "EvalResult": "bdh_train.train.evaluate",
    "GradientScale": "bdh_train.train.schedules",
    "GradientScaleRamp": "bdh_train.train.schedules",
    "GradientScaleSchedule": "bdh_train.train.schedules",
    "InitTransferConfig": "bdh_train.train.init_from",
    "LanguageTrainModel": "bdh_train.train.step",
    "OptimizerConfig": "bdh_train.train.optim",
    "StepExecutor": "bdh_train.train.step",
    "TrainingConfig": "bdh_train.train.config",
    "WeightedGradientAccumulator": "bdh_train.train.accumulate",
    "all_reduce_accumulated": "bdh_train.train.reduce",
    "evaluate": "bdh_train.train.evaluate",
    "init_weights_from": "bdh_train.train.init_from",
    "learning_rate": "bdh_train.train.optim",
}
"""Public name -> the module that defines it."""

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "EvalResult",
    "GradientScale",
    "GradientScaleRamp",
    "GradientScaleSchedule",
    "InitTransferConfig",
    "LanguageTrainModel",
    "OptimizerConfig",
    "StepExecutor",
    "TrainingConfig",
    "WeightedGradientAccumulator",
    "all_reduce_accumulated",
    "evaluate",
    "init_weights_from",
    "learning_rate",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


class _Package(types.ModuleType):
    """`evaluate` names both a submodule and the function it defines. Importing the submodule
    sets the package's attribute to the module; this keeps the public name the function, as
    it always was (and is in `__all__`), whichever is imported first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from bdh_train.storage.checkpoint import CheckpointConfig, Checkpointer
    from bdh_train.train.accumulate import WeightedGradientAccumulator
    from bdh_train.train.config import TrainingConfig
    from bdh_train.train.evaluate import EvalResult, evaluate
    from bdh_train.train.init_from import InitTransferConfig, init_weights_from
    from bdh_train.train.optim import OptimizerConfig, learning_rate
    from bdh_train.train.reduce import all_reduce_accumulated
    from bdh_train.train.schedules import GradientScale, GradientScaleRamp, GradientScaleSchedule
    from bdh_train.train.step import LanguageTrainModel, StepExecutor
