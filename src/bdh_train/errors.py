"""Exceptions the user sees. One base class so the CLI can turn any of them into one clear
message and a non-zero exit instead of a traceback."""

from __future__ import annotations


class BDHTrainError(Exception):
    """Base of every error caused by user input (configs, data, checkpoints)."""


class ConfigError(BDHTrainError, ValueError):
    """An invalid configuration value; the message names the field and the allowed range."""


class DataError(BDHTrainError, ValueError):
    """Unusable training data: missing, empty, too short, or ids outside the vocabulary."""


class CheckpointError(BDHTrainError, ValueError):
    """A checkpoint that cannot be loaded into this model or run."""
