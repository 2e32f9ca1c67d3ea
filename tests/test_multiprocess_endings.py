"""How a torchrun launch ends when it cannot go on: the main process refused the run
directory, or one process stopped answering. Every process ends with one `error:` line and
exit status 2 (no traceback of its own; torchrun prints its summary of the exits)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bdh_train.train.run_dir import RunDirLock

TINY = [
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "training.block_size=8",
    "training.batch_size=4",
    "training.log_every=1",
    "training.eval_every=0",
    "training.checkpoint_every=2",
]


def torchrun(run: Path, *sets: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node 2 -m bdh_train train` of the tiny run, with
    `sets` as more --set overrides."""
    return [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "bdh_train",
        "train",
        "--run-dir",
        str(run),
        *[a for o in [*TINY, *sets] for a in ("--set", o)],
    ]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def exit_statuses(torchrun_stderr: str) -> list[str]:
    """Each process's exit status as torchrun's failure summary lists them."""
    return sorted(re.findall(r"exitcode\s+:\s*(-?\d+)", torchrun_stderr))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_torchrun_into_a_locked_run_directory_is_one_error_line_per_process(tmp_path):
    """The main process cannot take the lock: it shares the refusal before any collective,
    so the other process raises the same error instead of failing in gloo's barrier."""
    run = tmp_path / "run"
    holder = RunDirLock(run).acquire()
    try:
        done = subprocess.run(
            torchrun(run, "training.max_steps=2", "parallel.collective_timeout_s=20"),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=50,
        )
    finally:
        holder.release()
    err = done.stderr
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "in use by another trainer" in errors[0], err[-3000:]
    assert errors[0] == errors[1], errors
    assert "[rank" not in err and "RuntimeError" not in err, err[-3000:]
    assert done.returncode == 1 and exit_statuses(err) == ["2", "2"], err[-3000:]
