"""training.threads = 0 (and --threads 0): the cores other work leaves free, read from a faked
/proc/loadavg; a count asked for, or OMP_NUM_THREADS, stands."""

from __future__ import annotations

import pytest
import torch

from bdh_train.shared import threads
from bdh_train.shared.threads import choose_threads, other_work, set_threads


@pytest.mark.parametrize(
    ("loadavg", "busy"),
    [
        ("1.30 0.90 0.50 3/200 4242\n", 1.3),  # the load: fewer than the 2 others running now
        ("4.80 3.10 2.00 2/310 4242\n", 1.0),  # one task besides the reader runs now
        ("0.95 0.40 0.10 1/120 4242\n", 0.0),  # the load remembers this process's own work
        ("garbage\n", 0.0),
    ],
)
def test_other_work_is_the_smaller_of_the_load_and_the_tasks_running_now(loadavg, busy):
    assert other_work(loadavg) == pytest.approx(busy)


@pytest.mark.parametrize(
    ("cpus", "current", "loadavg", "expected"),
    [
        (2, 2, "1.10 1.00 1.00 2/200 1\n", 1),  # a busy 2-core machine: 1 thread, not 2
        (2, 2, "0.30 0.20 0.20 1/200 1\n", 2),  # idle: both cores
        (2, 2, "0.60 0.50 0.50 2/200 1\n", 1),  # 1.4 free rounds to 1
        (8, 8, "3.00 3.00 3.00 5/400 1\n", 5),  # 3 busy of 8
        (8, 4, "0.00 0.00 0.00 1/400 1\n", 4),  # never above torch's own count
        (4, 4, "9.00 9.00 9.00 12/400 1\n", 1),  # at least one
    ],
)
def test_the_automatic_count_is_the_free_cores(cpus, current, loadavg, expected):
    choice = choose_threads(0, current, cpus, loadavg, omp=None)
    assert choice.threads == expected
    assert choice.reason.startswith(f"auto: {cpus} CPUs, ")


def test_a_count_asked_for_or_omp_num_threads_stands():
    busy = "9.00 9.00 9.00 12/400 1\n"
    assert choose_threads(2, 4, 4, busy, omp=None).describe() == "2 (as set)"
    assert choose_threads(0, 3, 4, busy, omp="3").describe() == "3 (OMP_NUM_THREADS=3)"


def test_set_threads_sets_torch_s_count_from_the_load(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "read_loadavg", lambda: "1.50 1.20 1.00 3/200 1\n")
    torch.set_num_threads(2)
    choice = set_threads(0)
    assert choice.threads == torch.get_num_threads() == 1
    assert choice.describe() == "1 (auto: 2 CPUs, 1.5 busy with other work; torch's count 2)"
