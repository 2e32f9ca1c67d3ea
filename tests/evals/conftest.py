"""What the evaluation tests share: one micro byte-level run trained through the CLI."""

from __future__ import annotations

import pytest
from helpers import MICRO_RUN, set_args

from bdh_train.cli import main


@pytest.fixture(scope="session")
def byte_run(tmp_path_factory):
    """A run directory of a 1-step micro byte model (block 16) on the built-in corpus."""
    path = tmp_path_factory.mktemp("byte-run")
    steps = ["training.max_steps=1", "training.eval_every=1", "training.checkpoint_every=1"]
    assert main(["train", "--run-dir", str(path), *set_args([*MICRO_RUN, *steps])]) == 0
    return path
