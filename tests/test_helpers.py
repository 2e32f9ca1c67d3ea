"""The toolbox's own guarantees: assert_close's bound, and a launcher that never leaks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close, run_multiprocess


def test_assert_close_is_the_norm_relative_bound() -> None:
    expected = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5
    actual = expected + torch.tensor([0.0, 1e-5], dtype=torch.float64)  # error 2e-6 of it
    assert_close(actual, expected, rtol=2.01e-6)
    with pytest.raises(AssertionError, match="what: norm-relative error 2.000e-06"):
        assert_close(actual, expected, rtol=1.99e-6, msg="what")
    assert_close(torch.zeros(3), torch.zeros(3), rtol=0.0)
    with pytest.raises(AssertionError):
        assert_close(torch.full((3,), 1e-20), torch.zeros(3), rtol=1e-3)
    assert_close(torch.full((3,), 1e-20), torch.zeros(3), rtol=1e-3, atol=1e-19)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.zeros(3), torch.zeros(4), rtol=1.0)


def test_assert_close_on_dicts_checks_keys_and_the_whole_vector() -> None:
    f64 = torch.float64
    expected = {"a": torch.tensor([3.0], dtype=f64), "b": torch.tensor([4.0], dtype=f64)}
    actual = {"b": torch.tensor([4.0], dtype=f64), "a": torch.tensor([3.0 + 1e-5], dtype=f64)}
    # 1e-5 off in "a" is 3.3e-6 of "a" but 2e-6 of the whole vector, which is what counts
    assert_close(actual, expected, rtol=2.01e-6)
    with pytest.raises(AssertionError):
        assert_close(actual["a"], expected["a"], rtol=2.01e-6)
    with pytest.raises(AssertionError, match="keys"):
        assert_close({"a": expected["a"]}, expected, rtol=1.0)


def _hang_worker(rank: int, world: int) -> None:
    """Rank 0 never reaches the barrier: the shape of a pipeline deadlock."""
    if rank == 0:
        time.sleep(600)
    dist.barrier()


def _rank_worker(rank: int, world: int) -> int:
    return rank


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_run_multiprocess_fails_fast_on_a_hang_and_leaves_no_process(tmp_path: Path) -> None:
    # Workers fork from a server that has imported torch; a first call starts that server
    # (~3 s), so the timeout below needs only to cover forking two workers and joining a group.
    # The group is joined under the same timeout: 2 s was too short on a busy CI machine (the
    # gloo mesh failed to connect, and the call reported that instead of the hang).
    assert run_multiprocess(_rank_worker, tmp_path / "warm", timeout=60.0) == [0, 1]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_multiprocess(_hang_worker, tmp_path / "hang", timeout=6.0)
    assert time.monotonic() - start < 30
    pid_files = list((tmp_path / "hang").glob("rank*.pid"))
    assert len(pid_files) == 2
    for pid_file in pid_files:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def _failing_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError(f"boom on rank {rank} of {world}")
    return rank


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_run_multiprocess_reports_a_worker_exception(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="boom on rank 1 of 2"):
        run_multiprocess(_failing_worker, tmp_path, timeout=30.0)
    assert "ValueError: boom" in (tmp_path / "rank1.err").read_text()
