"""Shared fixtures. Helpers (tiny models, assert_close, run_multiprocess) live in helpers.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(2)
    yield
