"""How a torchrun launch ends when it cannot go on: the main process refused the run
directory, or one process stopped answering. Every process ends with one `error:` line and
exit status 2 (no traceback of its own; torchrun prints its summary of the exits)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bdh_train.storage.run_dir import RunDirLock

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


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie its parent has not reaped counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (OSError, IndexError):
        return True


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_stopped_rank_ends_the_others_with_one_error_line(tmp_path):
    """Rank 1 is SIGSTOPped mid-run: rank 0's next collective times out after
    parallel.collective_timeout_s and it ends with one `error:` line naming rank 1 and the
    last checkpoint, exit 2 (not gloo's traceback)."""
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        torchrun(run, "training.max_steps=100000", "parallel.collective_timeout_s=5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    ranks: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while not (run / "checkpoints" / "latest").exists():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        workers = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks[int(next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1])] = int(pid)
        assert sorted(ranks) == [0, 1], workers
        os.kill(ranks[1], signal.SIGSTOP)
        deadline = time.monotonic() + 40
        while not _gone(ranks[0]):
            assert time.monotonic() < deadline, "rank 0 did not give up on the stopped rank"
            time.sleep(0.2)
        os.kill(ranks[1], signal.SIGKILL)  # torchrun would wait 30 s for it to end
        _, err = launcher.communicate(timeout=30)
    finally:
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        launcher.kill()
        launcher.wait()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith(
        "error: rank 1 did not answer within parallel.collective_timeout_s = 5 s"
    ), errors
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert errors[0].endswith(f"the last checkpoint is {last} (continue with --resume {run})")
    assert "[rank0]" not in err and "RuntimeError" not in err, err[-3000:]
    assert sorted(exit_statuses(err)) == ["-9", "2"], err[-3000:]
