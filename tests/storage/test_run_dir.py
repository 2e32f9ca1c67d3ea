"""The run directory's owner: a refused command leaves a run byte for byte as it was, every
file name of a run has one home, and reading a finished run imports nothing of training."""

from __future__ import annotations

import datetime
import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MICRO_RUN, assert_same_weights, set_args

from bdh_train.cli import main
from bdh_train.data import builtin_corpus
from bdh_train.errors import ConfigError
from bdh_train.storage.checkpoint import MODEL_FILE, io_advice, resolve_checkpoint
from bdh_train.storage.run_dir import (
    ERROR_LOG,
    LOCK_FILE,
    RunDir,
    RunDirInUse,
    RunDirLock,
    RunDirLost,
    lost_line,
)
from bdh_train.training.launch import plan_train, stamped_run_dir

MICRO = [
    *MICRO_RUN,
    "training.eval_every=0",
    "training.max_steps=2",
]
SETS = set_args(MICRO)
SRC = Path(__file__).resolve().parents[2] / "src" / "bdh_train"


def tree_digest(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under `root`: (kind and SHA-256 of a file's bytes, mode, mtime in ns)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        kind = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        out[str(path.relative_to(root))] = (kind, st.st_mode, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--run-dir", str(run), *SETS]) == 0
    assert (run / LOCK_FILE).is_file()  # the lock file stays; its lock is gone
    return run


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--run-dir", "{run}", *SETS],  # a fresh run into a used directory
        ["train", "--run-dir", "{run}", *SETS, "--set", "training.blok_size=3"],
        ["train", "--resume", "{run}", "--set", "training.blok_size=3"],  # a bad resume config
        ["train", "--resume", "{run}", "--set", "training.max_steps=1"],  # nothing to train
    ],
    ids=["fresh-into-used", "fresh-bad-config", "resume-bad-config", "resume-past-the-end"],
)
def test_a_refused_train_leaves_the_run_byte_for_byte(finished_run, argv, capsys):
    before = tree_digest(finished_run)
    code = main([a.format(run=finished_run) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert tree_digest(finished_run) == before
    assert not (finished_run / ERROR_LOG).exists()


def test_a_refused_train_leaves_an_empty_directory_empty(tmp_path, capsys):
    """An empty directory the user made is not the command's: no error log in it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--run-dir", str(empty), *SETS, "--set", "training.blok_size=3"]) == 2
    assert "unknown key training.blok_size" in capsys.readouterr().err
    assert list(empty.iterdir()) == []


def test_a_run_locked_by_another_trainer_is_left_alone(finished_run, capsys):
    holder = RunDirLock(finished_run).acquire()  # the lock file now holds this pid
    try:
        before = tree_digest(finished_run)
        assert main(["train", "--resume", str(finished_run), "--set=training.max_steps=3"]) == 2
        assert f"in use by another trainer (pid {os.getpid()})" in capsys.readouterr().err
        assert tree_digest(finished_run) == before
    finally:
        holder.release()


def test_an_error_of_a_run_the_command_owns_goes_to_its_log(tmp_path, capsys):
    """A trainer built on the run owns it: an error while it trains is logged there too."""
    run = tmp_path / "run"
    diverging = ["--set=optimizer.lr=1e30", "--set=training.max_consecutive_skips=0"]
    assert (
        main(["train", "--run-dir", str(run), *SETS, "--set=training.max_steps=6", *diverging]) == 2
    )
    message = capsys.readouterr().err.strip()
    assert "consecutive steps had a non-finite loss" in message
    assert (run / ERROR_LOG).read_text().strip().endswith(message)


def test_a_fresh_run_after_a_failed_start_drops_the_stale_error_log(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--config", str(tmp_path / "no.toml")]) == 2
    assert "no.toml" in (run / ERROR_LOG).read_text()  # the failed start's line
    capsys.readouterr()
    one_step = ["--set=training.max_steps=1", "--set=training.log_every=0"]  # no loss.png
    assert main(["train", "--run-dir", str(run), *SETS, *one_step]) == 0
    assert not (run / ERROR_LOG).exists()


def test_the_plan_of_train_and_resume(tmp_path):
    """--run-dir names a fresh run's directory (default runs/<date>-<time>); --resume DIR
    names the run to continue, a bare --resume the --run-dir (a --run-dir of another name
    than DIR: `test_resume_into_a_run_dir_of_its_own_branches_and_leaves_the_run`)."""
    fresh = plan_train("a", None)
    assert (str(fresh.run.path), fresh.resume, fresh.checkpoint, fresh.continued) == (
        "a",
        False,
        None,
        None,
    )
    for run_dir, resume, want in [("a", "", "a"), (None, "b", "b"), ("b/", "b", "b")]:
        plan = plan_train(run_dir, resume)
        assert (str(plan.run.path), plan.resume, plan.checkpoint) == (want, True, None)
        assert plan.continued is not None and str(plan.continued.path) == want
    stamped = plan_train(None, None)
    assert not stamped.resume and re.fullmatch(r"runs/\d{8}-\d{6}", str(stamped.run.path))
    with pytest.raises(ConfigError, match="--resume needs a run directory"):
        plan_train(None, "")


def test_commands_of_one_second_stamp_directories_of_their_own(tmp_path):
    """Without --run-dir a command's directory is runs/<date>-<time>; a second command in the
    same second (a fast run, a script) takes <date>-<time>-2, then -3, instead of being
    refused by the first one's run; a name taken by a file or a dangling link is skipped too."""
    now = datetime.datetime(2026, 12, 7, 21, 57, 36)
    first = stamped_run_dir(tmp_path, now)
    assert first == tmp_path / "20261207-215736"
    first.mkdir()
    assert stamped_run_dir(tmp_path, now) == tmp_path / "20261207-215736-2"
    (tmp_path / "20261207-215736-2").write_text("")
    (tmp_path / "20261207-215736-3").symlink_to(tmp_path / "missing")
    assert stamped_run_dir(tmp_path, now) == tmp_path / "20261207-215736-4"
    assert stamped_run_dir(tmp_path, now.replace(second=37)) == tmp_path / "20261207-215737"


def test_a_command_refused_a_stamped_directory_leaves_the_other_commands_run(tmp_path):
    """Two commands that named the same absent runs/<date>-<time> at one instant: the first
    takes it; the second is refused by its lock and, its error logged, leaves that run's lock
    and directory as they are (it never made them: no error log of its in there either)."""
    path = tmp_path / "runs" / "20261207-215736"
    first, second = RunDir(path, stamped=True), RunDir(path, stamped=True)
    first.lock()
    held = (path / LOCK_FILE).read_bytes()
    with pytest.raises(RunDirInUse, match="in use by another trainer"):
        second.lock()
    second.log_error("error: in use")
    assert not first.lost() and (path / LOCK_FILE).read_bytes() == held
    assert sorted(p.name for p in path.iterdir()) == [LOCK_FILE]
    first.unlock()


def test_a_launch_of_several_processes_needs_a_run_dir(tmp_path, monkeypatch, capsys):
    """Each torchrun process plans on its own clock, so two could stamp different
    runs/<date>-<time> directories: refused with one error line, nothing made."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="a launch of 2 processes needs --run-dir"):
        plan_train(None, None)
    assert main(["train", *SETS]) == 2
    assert capsys.readouterr().err.startswith("error: a launch of 2 processes needs --run-dir")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="a launch of 2 processes needs --run-dir"):
        plan_train("", None)  # --run-dir "$UNSET"
    assert str(plan_train("a", None).run.path) == "a"  # named: planned as before
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main(["train", *SETS]) == 2
    assert capsys.readouterr().err.startswith("error: WORLD_SIZE='two' in the environment is not")
    assert list(tmp_path.iterdir()) == []


def test_resume_into_a_run_dir_of_its_own_branches_and_leaves_the_run(finished_run, tmp_path):
    """--resume RUN --run-dir NEW: a new run in NEW continues RUN's latest checkpoint, as
    --resume RUN/checkpoints/step-N --run-dir NEW does (the same weights, bit for bit); RUN
    is left as it was."""
    before = tree_digest(finished_run)
    latest = resolve_checkpoint(finished_run)
    branch, by_checkpoint = tmp_path / "branch", tmp_path / "by-checkpoint"
    plan = plan_train(str(branch), str(finished_run))
    assert (plan.run.path, plan.resume, plan.checkpoint) == (branch, False, finished_run)
    assert plan.continued is not None and plan.continued.path == finished_run
    on = ["--set", "training.max_steps=4"]
    assert main(["train", "--resume", str(finished_run), "--run-dir", str(branch), *on]) == 0
    assert main(["train", "--resume", str(latest), "--run-dir", str(by_checkpoint), *on]) == 0
    assert tree_digest(finished_run) == before
    assert resolve_checkpoint(branch).name == "step-0000004"
    assert_same_weights(branch, by_checkpoint)
    # RUN's latest damaged: the branch refuses it, or takes the newest intact with the flag
    run = tmp_path / "run"
    shutil.copytree(branch, run)
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=6"]) == 0  # 4 and 6
    (resolve_checkpoint(run) / MODEL_FILE).write_bytes(b"damaged")
    before, fallback = tree_digest(run), ["--set", "training.max_steps=6", "--resume-fallback"]
    assert main(["train", "--resume", str(run), "--run-dir", str(tmp_path / "refused")]) == 2
    assert main(["train", "--resume", str(run), "--run-dir", str(tmp_path / "f"), *fallback]) == 0
    assert resolve_checkpoint(tmp_path / "f").name == "step-0000006"
    assert tree_digest(run) == before


def test_resume_names_what_is_missing_and_takes_the_checkpoints_folder(
    finished_run, tmp_path, capsys
):
    """--resume of a path that does not exist says so (not that its config.toml is missing)
    and creates nothing; of a directory without a run's config, that; RUN/checkpoints
    continues RUN, as generate and eval read it."""
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--resume", str(missing)]) == 2
    assert f"error: cannot resume: {missing} does not exist; give a run directory" in (
        capsys.readouterr().err
    )
    assert main(["train", "--resume", str(empty)]) == 2
    assert f"{empty / 'config.toml'} does not exist (is {empty} a run" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == [empty] and not any(empty.iterdir())
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    argv = ["train", "--resume", str(run / "checkpoints"), "--set", "training.max_steps=3"]
    assert main(argv) == 0
    assert resolve_checkpoint(run).name == "step-0000003"
    bare = ["train", "--run-dir", str(run / "checkpoints"), "--resume"]  # --resume: --run-dir's
    assert main([*bare, "--set", "training.max_steps=4"]) == 0
    assert resolve_checkpoint(run).name == "step-0000004"


def test_a_run_dir_under_a_file_is_answered_with_its_path_not_with_free_space(tmp_path, capsys):
    """A --run-dir whose parent is a file fails with ENOTDIR, which no free space fixes: the
    line says the path cannot be used; a full disk (ENOSPC) keeps the advice to free space."""
    parent = tmp_path / "notes.txt"
    parent.write_text("mine")
    assert main(["train", "--run-dir", str(parent / "run"), *SETS]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Not a directory") and "free space" not in err
    assert f"the run directory {parent / 'run'} cannot be made or written there" in err
    assert parent.read_text() == "mine" and sorted(tmp_path.iterdir()) == [parent]
    full = OSError(errno.ENOSPC, "No space left on device")
    assert "no checkpoint was written: free space" in io_advice(tmp_path, full)


def test_a_resume_whose_corpus_moved_says_how_to_name_where(tmp_path, capsys):
    """The run's corpus file was moved: --resume says data.source is gone and to name where
    it is (the run left as it was); --set data.source=NEW then resumes."""
    corpus, run = tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text(builtin_corpus("shakespeare")[:20_000])
    assert main(["train", "--run-dir", str(run), *SETS, "--set", f"data.source={corpus}"]) == 0
    moved = corpus.rename(tmp_path / "moved.txt")
    before = tree_digest(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=3"]) == 2
    assert capsys.readouterr().err == (
        f"error: data.source '{corpus}' of the run's config ({run / 'config.toml'}) does not "
        "exist: if the run's corpus moved, resume with --set data.source=WHERE_IT_IS_NOW (the "
        "same data; the checkpoint's loader checks it is)\n"
    )
    assert tree_digest(run) == before
    again = ["--set", "training.max_steps=3", "--set", f"data.source={moved}"]
    assert main(["train", "--resume", str(run), *again]) == 0


def test_each_run_file_name_has_one_home():
    """The names of a run's files are spelt only in storage/places.py."""
    names = ['"metrics.jsonl"', '"config.toml"', '"checkpoints"', '"loss.png"', '"error.log"']
    found = {
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        for name in names
        if name in path.read_text(encoding="utf-8")
    }
    assert found == {"storage/places.py"}


def test_the_model_config_metadata_key_has_one_home():
    """The key model.safetensors' metadata holds the model's config under is spelt only in
    storage/places.py (`MODEL_CONFIG_KEY`); messages and the v0.1 check use the constant."""
    spelt = re.compile(r"""["']bdh_config["']""")
    found = {
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if spelt.search(path.read_text(encoding="utf-8"))
    }
    assert found == {"storage/places.py"}


def test_reading_a_finished_run_imports_nothing_of_training():
    """Importing `bdh_train.shared.loading` and `bdh_train.generation.chat` (load_run,
    generate, chat) leaves out the trainer, FSDP,
    the pipeline planner and runner, and the training-only components."""
    code = (
        "import sys, bdh_train.shared.loading, bdh_train.generation.chat; "
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    unwanted = [
        m
        for m in out
        if m == "bdh_train.training.trainer"
        or m.startswith(("torch.distributed.fsdp", "torch.distributed.pipelining"))
        or m in ("bdh_train.distributed.planner", "bdh_train.distributed.pipeline")
        or m in ("bdh_train.train.accumulate", "bdh_train.train.step", "bdh_train.train.reduce")
    ]
    assert unwanted == []
    assert "bdh_train.shared.loading" in out


def test_the_lost_run_line_says_where_the_run_went_or_that_the_system_does_not_say(tmp_path):
    run = tmp_path / "run"
    places = (None, f"{tmp_path}/r2/.lock", f"{run}/.lock (deleted)", f"{run}/.nfs0001")
    lines = [lost_line(run, where) for where in places]
    went = [line.split("): ")[1].split("; stopped")[0] for line in lines]
    assert went == [
        "it was moved, removed or replaced",
        f"it was moved to {tmp_path}/r2: continue it there with bdh-train train --resume "
        f"{tmp_path}/r2",
        "its lock file was deleted, with the directory or alone",
        "it was moved, removed or replaced",  # NFS keeps a removed open file as .nfsXXXX
    ]
    assert lines[0].startswith(f"run directory {run} is no longer this trainer's ({run}/.lock ")


def test_a_process_without_the_lock_tells_a_replaced_directory_by_the_lock_file_it_claimed(
    tmp_path,
):
    """A rank other than the main one holds no lock: it remembers the lock file it found
    when it claimed the directory, so once the directory is replaced by another run it
    refuses to write there too (`check_owned`) and logs no error into it."""
    run = tmp_path / "run"
    main_rank = RunDir(run)
    main_rank.lock()
    other_rank = RunDir(run, fresh=False)
    other_rank.claim()
    main_rank.claim()
    other_rank.check_owned()  # still the same directory: nothing raised
    shutil.rmtree(run)  # while the main rank runs, holding its lock file open
    newcomer = RunDirLock(run).acquire()
    assert other_rank.lost() and main_rank.lost()
    main_rank.unlock()
    other_rank.log_error("error: a line that must not land in the new run")
    with pytest.raises(RunDirLost, match="it was moved, removed or replaced; stopped without"):
        other_rank.check_owned()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    newcomer.release()
