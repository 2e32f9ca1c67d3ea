"""bdh-train: a training system for Dragon Hatchling (BDH) language models.

The public names below are the package's API; `tests/test_api.py` pins them.
"""

from bdh_train.batch import IGNORE_INDEX, SequenceBatch, StepOutput
from bdh_train.config import RunConfig, load_config
from bdh_train.model import BDH, BDHConfig, ModelState
from bdh_train.train.accumulate import WeightedGradientAccumulator
from bdh_train.train.step import LanguageTrainModel
from bdh_train.trainer import Trainer

__version__ = "0.1.0"
__all__ = [
    "BDH",
    "IGNORE_INDEX",
    "BDHConfig",
    "LanguageTrainModel",
    "ModelState",
    "RunConfig",
    "SequenceBatch",
    "StepOutput",
    "Trainer",
    "WeightedGradientAccumulator",
    "__version__",
    "load_config",
]
