"""No flag, path or pipe makes `bdh-train train` destroy a user's files: --overwrite replaces
only a run, a checkpoint directory is never written into, run files are never written through
a link, a resume keeps the model and data, and Ctrl-C saves even when the console is gone."""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import MICRO_RUN, checkpoint_weights, cli_main, metric_rows, set_args, start_process

from bdh_train.cli import main
from bdh_train.errors import ConfigError
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.run_dir import ERROR_LOG, LOCK_FILE
from bdh_train.train.console import command_name
from bdh_train.train.metrics import MetricsLog

MICRO = [
    *MICRO_RUN,
    "training.log_every=1",
    "training.eval_every=0",
    "training.checkpoint_every=2",
    "training.keep_checkpoints=0",
]
SETS = set_args(MICRO)


def digest(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under `root` (links as links): a file's SHA-256 or a link's target, and
    its mtime in ns."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_symlink():
            kind = "-> " + os.readlink(path)
        elif path.is_dir():
            kind = "dir"
        else:
            kind = hashlib.sha256(path.read_bytes()).hexdigest()
        out[str(path.relative_to(root))] = (kind, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def run4(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints step-0000002 and step-0000004."""
    run = tmp_path_factory.mktemp("run4") / "run"
    assert main(["train", "--run-dir", str(run), *SETS, "--set", "training.max_steps=4"]) == 0
    return run


def copy_of(run: Path, where: Path) -> Path:
    import shutil

    shutil.copytree(run, where, symlinks=True)
    return where


# ------------------------------------------------------------------ --overwrite
def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    mine = tmp_path / "notarun"
    (mine / "photos").mkdir(parents=True)
    (mine / "thesis.txt").write_text("three years of work")
    (mine / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    before = digest(mine)
    argv = ["train", "--run-dir", str(mine), *SETS, "--set=training.max_steps=1", "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds files that are not a bdh-train run's" in err
    assert "photos, thesis.txt" in err and "--overwrite replaces only a run directory" in err
    assert digest(mine) == before


def test_overwrite_replaces_a_run_and_an_empty_directory(run4, tmp_path):
    run = copy_of(run4, tmp_path / "run")
    argv = ["train", "--run-dir", str(run), *SETS, "--set=training.max_steps=1", "--overwrite"]
    assert main(argv) == 0
    assert [r["step"] for r in metric_rows(run)] == [1]
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["train", "--run-dir", str(empty), *SETS, "--set=training.max_steps=1", "--overwrite"]
    assert main(argv) == 0


def test_overwrite_refuses_a_run_with_a_foreign_file_in_it(run4, tmp_path, capsys):
    run = copy_of(run4, tmp_path / "run")
    (run / "notes.md").write_text("my notes on this run")
    before = digest(run)
    argv = ["train", "--run-dir", str(run), *SETS, "--set=training.max_steps=1", "--overwrite"]
    assert main(argv) == 2
    assert "(notes.md)" in capsys.readouterr().err
    assert digest(run) == before


# ------------------------------------------------------------------ --resume CHECKPOINT
def test_resume_from_the_newest_checkpoint_continues_its_run(run4, tmp_path):
    run = copy_of(run4, tmp_path / "run")
    newest = run / "checkpoints" / "step-0000004"
    before = digest(newest)
    assert main(["train", "--resume", str(newest), "--set=training.max_steps=6"]) == 0
    assert digest(newest) == before  # nothing written inside the checkpoint
    assert ckpt.resolve_checkpoint(run).name == "step-0000006"
    assert not (newest / "checkpoints").exists() and not (newest / ERROR_LOG).exists()


def test_resume_from_an_older_checkpoint_is_refused_in_its_run(run4, tmp_path, capsys):
    run = copy_of(run4, tmp_path / "run")
    before = digest(run)
    older = run / "checkpoints" / "step-0000002"
    assert main(["train", "--resume", str(older), "--set=training.max_steps=6"]) == 2
    err = capsys.readouterr().err
    assert "is not the newest checkpoint" in err and "--run-dir NEW --resume" in err
    assert digest(run) == before


def test_a_checkpoint_continues_bit_exactly_in_a_new_run_directory(run4, tmp_path):
    """Step 2's checkpoint continued in a new run directory to step 4 ends with exactly the
    weights the run had at step 4; the run it came from is untouched."""
    before = digest(run4)
    new = tmp_path / "new"
    older = run4 / "checkpoints" / "step-0000002"
    argv = ["train", "--run-dir", str(new), "--resume", str(older), "--set=training.max_steps=4"]
    assert main(argv) == 0
    assert digest(run4) == before
    a, b = checkpoint_weights(run4), checkpoint_weights(new)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r for r in metric_rows(new)] == [r for r in metric_rows(run4) if r["step"] > 2]


def test_a_checkpoint_not_named_as_the_runs_are_is_refused_in_its_run(run4, tmp_path, capsys):
    """checkpoints/mycopy (a user's copy) is none of the run's checkpoints, even as the only
    directory there."""
    import shutil

    run = copy_of(run4, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-0000002")
    (run / "checkpoints" / "step-0000004").rename(run / "checkpoints" / "mycopy")
    before = digest(run)
    mine = run / "checkpoints" / "mycopy"
    assert main(["train", "--resume", str(mine), "--set=training.max_steps=6"]) == 2
    assert f"{mine} is not the newest checkpoint of {run}: " in capsys.readouterr().err
    assert digest(run) == before


def test_a_checkpoint_outside_a_run_needs_a_run_directory(run4, tmp_path, capsys):
    loose = copy_of(run4 / "checkpoints" / "step-0000004", tmp_path / "loose")
    before = digest(loose)
    assert main(["train", "--resume", str(loose), "--set=training.max_steps=6"]) == 2
    assert "is a checkpoint outside a run directory" in capsys.readouterr().err
    assert digest(loose) == before


# ------------------------------------------------------------------ links
def test_a_linked_lock_file_is_refused_and_its_target_untouched(run4, tmp_path, capsys):
    run = copy_of(run4, tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / LOCK_FILE).unlink(missing_ok=True)
    (run / LOCK_FILE).symlink_to(victim)
    assert main(["train", "--resume", str(run), "--set=training.max_steps=6"]) == 2
    err = capsys.readouterr().err
    assert f"{run / LOCK_FILE} is a symbolic link" in err
    assert victim.read_text() == "precious"


def test_the_error_log_and_metrics_are_not_written_through_links(tmp_path, capsys):
    run = tmp_path / "run"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run.mkdir()
    (run / ERROR_LOG).symlink_to(victim)
    diverging = ["--set=optimizer.lr=1e30", "--set=training.max_consecutive_skips=0"]
    argv = ["train", "--run-dir", str(run), *SETS, "--set=training.max_steps=6", *diverging]
    assert main(argv) == 2  # the run's error goes to stderr; the log is a link: not written
    assert "non-finite" in capsys.readouterr().err
    assert victim.read_text() == "precious"
    log = MetricsLog(tmp_path)  # a fresh run's metrics, then a link planted in their place
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="metrics.jsonl is a symbolic link"):
        log.write({"step": 1, "loss": 1.0})
    assert victim.read_text() == "precious"


def test_a_resume_replaces_a_linked_metrics_file_and_leaves_its_target(run4, tmp_path):
    run = copy_of(run4, tmp_path / "run")
    victim = tmp_path / "victim.jsonl"
    victim.write_bytes((run / "metrics.jsonl").read_bytes())
    before = victim.read_bytes()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    assert main(["train", "--resume", str(run), "--set=training.max_steps=6"]) == 0
    assert victim.read_bytes() == before
    assert not (run / "metrics.jsonl").is_symlink()
    assert [r["step"] for r in metric_rows(run)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("name", ["tensorboard", "checkpoints"])
def test_a_resume_never_writes_or_prunes_through_a_linked_folder(run4, tmp_path, capsys, name):
    run = copy_of(run4, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    if name == "checkpoints":
        (run / name).rename(elsewhere)  # the run's own checkpoints, moved and linked back
    else:
        elsewhere.mkdir()
        (elsewhere / "mine.txt").write_text("a user's file")
    (run / name).symlink_to(elsewhere)
    before, before_run = digest(elsewhere), digest(run)
    argv = ["train", "--resume", str(run), "--set=training.max_steps=6"]
    argv += ["--set=training.keep_checkpoints=1", "--set=metrics.report_to=['jsonl','tensorboard']"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / name} is a symbolic link to {elsewhere}" in err
    assert digest(elsewhere) == before and digest(run) == before_run


def test_overwrite_refuses_a_users_file_in_tensorboard(run4, tmp_path, capsys):
    run = copy_of(run4, tmp_path / "run")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"events")
    (run / "tensorboard" / "notes.md").write_text("mine")
    before = digest(run)
    argv = ["train", "--run-dir", str(run), *SETS, "--set=training.max_steps=1", "--overwrite"]
    assert main(argv) == 2
    assert "(tensorboard/notes.md)" in capsys.readouterr().err
    assert digest(run) == before


# ------------------------------------------------------------------ what a resume may change
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.n_layer=3", "model.n_layer"),
        ("model.position='rope'", "model.position"),
        ("data.val_fraction=0.2", "data.val_fraction"),
    ],
)
def test_a_resume_refuses_another_model_or_data(run4, tmp_path, capsys, override, key):
    run = copy_of(run4, tmp_path / "run")
    before = digest(run)
    assert (
        main(["train", "--resume", str(run), "--set=training.max_steps=6", "--set", override]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key} is ") and err.count("\n") == 1
    assert "checkpoint.init_from" in err
    assert digest(run) == before


def test_a_resume_may_change_the_length_rates_and_logging(run4, tmp_path):
    run = copy_of(run4, tmp_path / "run")
    changes = [
        "--set=optimizer.lr=1e-3",
        "--set=training.log_every=2",
        "--set=metrics.report_to=['jsonl']",
    ]
    assert main(["train", "--resume", str(run), "--set=training.max_steps=6", *changes]) == 0
    assert ckpt.resolve_checkpoint(run).name == "step-0000006"


# ------------------------------------------------------------------ a console that goes away
@pytest.mark.timeout(180)
def test_ctrl_c_with_the_console_gone_still_saves(tmp_path):
    """`bdh-train train ... 2>&1 | tee log` and Ctrl-C: the terminal's SIGINT ends `tee` first,
    so every later print meets a closed pipe. The run still checkpoints, exits 75 (stopped,
    resumable), and its error log says where the checkpoint is."""
    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), *SETS]
    argv += ["--set=training.max_steps=100000", "--set=training.checkpoint_every=0"]
    console = tmp_path / "console"
    os.mkfifo(console)  # the pipe to `tee`
    with start_process(cli_main, argv, stdout=console) as proc:
        tee = os.open(console, os.O_RDONLY | os.O_NONBLOCK)  # no wait for a writer to open it
        try:
            seen, deadline = b"", time.monotonic() + 120
            while b"step " not in seen:  # training has started
                assert proc.is_alive() and time.monotonic() < deadline, seen[-2000:]
                select.select([tee], [], [], 0.5)
                with contextlib.suppress(BlockingIOError):
                    read = os.read(tee, 1 << 16)
                    seen += read
                    if not read:  # no writer yet
                        time.sleep(0.05)
        finally:
            os.close(tee)  # the reader (tee) is gone
        time.sleep(0.5)
        assert proc.pid is not None and proc.is_alive(), "the run died with its console"
        os.kill(proc.pid, signal.SIGINT)
        proc.join(timeout=120)
        assert proc.exitcode == 75
    stopped = ckpt.resolve_checkpoint(run)
    log = (run / ERROR_LOG).read_text()
    assert f"checkpoint {stopped}" in log and f"{command_name()} train --resume" in log
