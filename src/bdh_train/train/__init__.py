"""Training components: the train step, exact weighted accumulation and its cross-rank
reduction, schedules, the optimizer, checkpoints, evaluation, metrics and profiling. Each
owns its config section where it has one; `bdh_train.trainer` assembles them."""

from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.checkpoint import CheckpointConfig, Checkpointer
from bdh_train.train.config import TrainingConfig
from bdh_train.train.evaluate import EvalResult, evaluate
from bdh_train.train.init_from import InitTransferConfig, init_weights_from
from bdh_train.train.optim import OptimizerConfig, learning_rate
from bdh_train.train.reduce import all_reduce_accumulated
from bdh_train.train.schedules import GradientScale, GradientScaleRamp, GradientScaleSchedule
from bdh_train.train.step import LanguageTrainModel, StepExecutor

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
