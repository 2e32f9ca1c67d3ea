"""bdh-train: a training system for Dragon Hatchling (BDH) language models."""

from bdh_train.model import BDH, BDHConfig, ModelState
from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.batch import SequenceBatch
from bdh_train.train.step import LanguageTrainModel

__version__ = "0.1.0"
__all__ = [
    "BDH",
    "BDHConfig",
    "LanguageTrainModel",
    "ModelState",
    "SequenceBatch",
    "WeightedGradientAccumulator",
    "__version__",
]
