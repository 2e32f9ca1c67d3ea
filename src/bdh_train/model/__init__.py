"""The BDH model: config, module, state, executors, positions."""

from bdh_train.model.bdh import BDH
from bdh_train.model.config import BDHConfig, LanguageHeadConfig, QuantConfig
from bdh_train.model.sampling import sample_next_token
from bdh_train.model.state import ModelState

__all__ = [
    "BDH",
    "BDHConfig",
    "LanguageHeadConfig",
    "ModelState",
    "QuantConfig",
    "sample_next_token",
]
