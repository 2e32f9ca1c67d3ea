"""What every pytest process of the suite needs: the order and grouping of test files under
pytest-xdist, and, in each process that runs tests (not an xdist controller), the fixtures
and environment of suite_setup.py."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    """suite_setup.py's fixtures where tests run: in one process, or in each xdist worker."""
    controller = bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")
    if not controller:
        config.pluginmanager.import_plugin("suite_setup")


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker (`make test`: `--dist loadfile --no-loadscope-reorder`, a
    file's tests on one worker, in the order collected) the files holding slow or
    multi-process tests go first, so that none of them starts while the other worker has
    nothing left to run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        long_files = {
            item.path
            for item in items
            if item.get_closest_marker("slow") or item.get_closest_marker("multiprocess")
        }
        items.sort(key=lambda item: item.path not in long_files)


SAME_WORKER = {"tests/model/test_gate.py": "tests/training/test_trainer.py"}
"""Test files that run in the pytest-xdist worker of another file (`--dist loadfile`): the
files whose tests compile with inductor, so that a worker's first compile (about 5 s of CPU
that inductor spends once a process) is paid once."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files of SAME_WORKER in the unit of the file they name."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SAME_WORKER.get(file, file)

    return Scheduling(config, log)
