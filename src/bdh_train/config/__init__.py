"""The run configuration: `RunConfig` (one section per component, each validated by its
owner) and its layering from presets, TOML files and `--set` overrides."""

from bdh_train.config.layering import (
    DEFAULT_PRESET,
    PRESETS,
    dump_toml,
    load_config,
    load_train_config,
    parse_override,
    save_config,
)
from bdh_train.config.schema import SECTIONS, RunConfig

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "SECTIONS",
    "RunConfig",
    "dump_toml",
    "load_config",
    "load_train_config",
    "parse_override",
    "save_config",
]
