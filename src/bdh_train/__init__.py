"""bdh-train: a training system for Dragon Hatchling (BDH) language models.

The public names below are the package's API; `tests/test_api.py` pins them. They are imported
on first use (PEP 562), so importing the package (and so the CLI, for `--help`) does not pay
for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bdh_train.utils import lazy_names

__version__ = "0.1.0"

_LAZY = {
    "BDH": "bdh_train.model",
    "BDHConfig": "bdh_train.model",
    "IGNORE_INDEX": "bdh_train.batch",
    "LanguageTrainModel": "bdh_train.train.step",
    "ModelState": "bdh_train.model",
    "RunConfig": "bdh_train.config",
    "SequenceBatch": "bdh_train.batch",
    "StepOutput": "bdh_train.batch",
    "Trainer": "bdh_train.training.trainer",
    "WeightedGradientAccumulator": "bdh_train.train.accumulate",
    "load_config": "bdh_train.config",
    "load_run": "bdh_train.shared.loading",
    "score_text": "bdh_train.evals.text_score",
}
"""Public name -> the module that defines it."""

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
    "load_run",
    "score_text",
]


__getattr__, __dir__ = lazy_names("bdh_train", _LAZY)


if TYPE_CHECKING:
    from bdh_train.batch import IGNORE_INDEX, SequenceBatch, StepOutput
    from bdh_train.config import RunConfig, load_config
    from bdh_train.evals.text_score import score_text
    from bdh_train.model import BDH, BDHConfig, ModelState
    from bdh_train.shared.loading import load_run
    from bdh_train.train.accumulate import WeightedGradientAccumulator
    from bdh_train.train.step import LanguageTrainModel
    from bdh_train.training.trainer import Trainer
