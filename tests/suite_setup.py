"""The fixtures and environment of a process that runs tests (conftest.py registers this
module as a plugin there, and not in a pytest-xdist controller, which runs none and so starts
its workers without importing torch). Helpers (tiny models, assert_close, run_multiprocess)
live in helpers.py."""

from __future__ import annotations

import atexit
import datetime
import os
import resource
import sys
from pathlib import Path

import pytest

# inductor compiles its kernels in the test's own process: its default pool of compile
# workers would start (and import torch in) two more processes in every xdist worker that
# compiles, about 4 s of CPU each time
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# the suite runs as on a CPU whose bfloat16 products do not use AMX tiles, so that
# training.dtype = 'auto' (the tiny preset's) is float32 on every host and the tests' figures
# are the same on an Intel Xeon with AMX as elsewhere (`cpu_has_bfloat16_tiles`; the tests of
# the AMX choice patch its probe and this cap); float32 products never use the tiles
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"

import torch
import torch.distributed as dist
from helpers import TEST_THREADS, constant_peak, short_run_end

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the processes a worker's tests start (bdh-train commands, the README's fork server) run
    # TEST_THREADS torch threads as its tests do (1 with `make test`'s two workers): two
    # threads in each of two workers on two cores wait on each other (the README's blocks
    # took 11 s more CPU with two)
    os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)

from bdh_train.shared import threads
from bdh_train.train.metrics import MetricsReporter
from bdh_train.training.trainer import Trainer


@pytest.fixture(autouse=True)
def _deterministic_threads(monkeypatch):
    """TEST_THREADS torch threads in every test, also in runs with training.threads = 0: in
    an xdist worker that count takes OMP_NUM_THREADS (set above), elsewhere the automatic
    count sees an idle machine (tests/shared/test_threads.py fakes the load it reads)."""
    torch.set_num_threads(TEST_THREADS)
    monkeypatch.setattr(threads, "read_loadavg", lambda: None)
    yield


@pytest.fixture(autouse=True)
def _constant_peak(monkeypatch):
    """Every run's peak is the constant `helpers.TEST_PEAK_FLOPS`."""
    constant_peak(monkeypatch.setattr)


USER_PLOT = {(MetricsReporter, "plot"): MetricsReporter.plot}
"""The loss plot the in-process runs skip, as a user's run draws it."""

USER_RUN_END = {
    (Trainer, "state_gain"): Trainer.state_gain,
    (Trainer, "end_sample_tokens"): Trainer.end_sample_tokens,
    **USER_PLOT,
}
"""What the in-process runs' short end replaces, as a user's run has it."""


@pytest.fixture(scope="session", autouse=True)
def _short_run_ends():
    """Every in-process run of the session ends short (`helpers.short_run_end`) and draws no
    loss.png (0.24 s of matplotlib in each of about 140 runs), also those that module- and
    session-scoped fixtures train before any test's own fixtures exist. The plot is drawn
    in tests marked `run_end` or `loss_plot`, in the commands the suite starts as processes
    of their own and by `bdh-train plot` (tests/cli)."""
    with pytest.MonkeyPatch.context() as patch:
        short_run_end(patch.setattr)
        patch.setattr(MetricsReporter, "plot", lambda self: None)
        yield


@pytest.fixture(autouse=True)
def _run_end_where_marked(request, monkeypatch):
    """In a test marked `run_end`, runs end as a user's do (full samples, the state-gain
    line, loss.png); in one marked `loss_plot`, they draw loss.png."""
    restored = {}
    if request.node.get_closest_marker("loss_plot") is not None:
        restored = USER_PLOT
    if request.node.get_closest_marker("run_end") is not None:
        restored = USER_RUN_END
    for (owner, name), value in restored.items():
        monkeypatch.setattr(owner, name, value)


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


HEADROOM = 256 << 20
"""How much more address space a test under `bounded_memory` may map."""


@pytest.fixture
def bounded_memory():
    """For the test's duration, mapping more than HEADROOM beyond what the process maps now
    fails (MemoryError): a read without a bound fails fast instead of filling the machine."""
    with open("/proc/self/statm") as handle:
        mapped = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def pytest_unconfigure(config):
    """A pytest-xdist worker leaves without Python's teardown once its session has ended and
    its results are sent: freeing torch and two thousand tests' objects took 2-3 s of the
    suite's wall time, with the controller waiting and nothing left to write."""
    if hasattr(config, "workerinput"):
        atexit.register(_leave)  # runs first: atexit calls the newest first


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
