"""Shared fixtures. Helpers (tiny models, assert_close, run_multiprocess) live in helpers.py."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture
def single_process_group(tmp_path: Path):
    """A world-size-1 gloo group in this process, destroyed even when the test fails: the
    collective code paths run, and a SUM or MAX all-reduce over one rank is the identity."""
    assert not dist.is_initialized(), "an earlier test leaked a default process group"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
