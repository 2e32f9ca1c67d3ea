"""What an operator meets when things go wrong: a damaged latest checkpoint, I/O failures
(file size limit, read-only directory), untrusted sizes, corrupt checkpoint parts, a signal
to one DDP rank, and SIGKILLs at random points. Every user-facing failure is one `error:`
line and exit status 2, and the last checkpoint stays intact and resumable."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    FRESH_BLOCKS,
    MICRO_RUN,
    STREAMING_TBPTT_SETTINGS,
    assert_same_run,
    cli_as_rank,
    cli_main,
    run_multiprocess,
    set_args,
    start_process,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bdh_train.cli import main
from bdh_train.errors import ConfigError
from bdh_train.model import BDH, BDHConfig
from bdh_train.model import bdh as bdh_module
from bdh_train.storage import checkpoint as ckpt
from bdh_train.train.metrics import read_metrics

MICRO = [
    *MICRO_RUN,
    *FRESH_BLOCKS,  # a checkpoint without a carried state fits the 512 KiB disk; a mesh runs it
    "training.log_every=1",
    "training.eval_every=0",
    "training.checkpoint_every=2",
    "training.keep_checkpoints=0",
    "training.max_steps=4",
]
SETS = set_args(MICRO)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ------------------------------------------------------------------ --resume-fallback
def test_resume_fallback_continues_from_the_newest_intact_checkpoint(tmp_path, capsys):
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert main(["train", "--run-dir", str(whole), *SETS]) == 0
    assert main(["train", "--run-dir", str(run), *SETS, "--set", "training.max_steps=3"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-0000002",
        "step-0000003",
    ]
    damaged = run / "checkpoints" / "step-0000003" / ckpt.MODEL_FILE
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    capsys.readouterr()

    assert main(["train", "--resume", str(run), "--set", "training.max_steps=4"]) == 2
    line = one_error_line(capsys)
    assert "SHA-256" in line and "step-0000002" in line and "--resume-fallback" in line

    assert (
        main(["train", "--resume", str(run), "--resume-fallback", "--set", "training.max_steps=4"])
        == 0
    )
    assert "resumed from " + str(run / "checkpoints" / "step-0000002") in capsys.readouterr().out
    assert_same_run(whole, run)


# ------------------------------------------------------------------ one error line, exit 2
@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished two-step run (one checkpoint, step-0000002) to copy and damage."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", "--run-dir", str(run), *SETS, "--set", "training.max_steps=2"]) == 0
    return run


def copy_run(base: Path, where: Path) -> Path:
    shutil.copytree(base, where)
    (where / ".lock").unlink(missing_ok=True)
    return where


def leftovers(run: Path) -> list[str]:
    return [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp", ".old"))]


def test_run_dir_naming_a_file_and_a_non_utf8_config(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    assert main(["train", "--run-dir", str(a_file), *SETS]) == 2
    assert one_error_line(capsys) == (
        f"error: run directory {a_file} is a file, not a directory; choose another --run-dir"
    )
    assert a_file.read_text() == "mine\n"
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[training]\n# caf\xe9\nmax_steps = 2\n")
    assert main(["train", "--config", str(bad), "--run-dir", str(tmp_path / "r"), *SETS]) == 2
    line = one_error_line(capsys)
    assert f"config file {bad} is not UTF-8 text (byte 16" in line
    assert not (tmp_path / "r" / "checkpoints").exists()


def _rewrite_part(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file and re-sign the manifest: damage the checksum cannot see."""
    (checkpoint / name).write_bytes(data)
    ckpt.write_manifest(checkpoint)


def _pickled_namespace() -> bytes:
    """A ranks.pt holding an object torch's safe loader refuses (its message runs to 6 lines)."""
    buffer = io.BytesIO()
    torch.save({"rng": argparse.Namespace(a=1)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "part, data, expected",
    [
        ("trainer.json", b"{}", "(trainer.json): it lacks the counters step, micro, tokens"),
        ("ranks.pt", b"PK\x03\x04 not a zip archive", "ranks.pt ("),
        ("ranks.pt", _pickled_namespace(), "ranks.pt (Weights only load failed"),
    ],
    ids=["empty-trainer-json", "corrupt-ranks-pt", "ranks-pt-with-foreign-objects"],
)
def test_damaged_checkpoint_parts_are_one_line(base_run, tmp_path, capsys, part, data, expected):
    run = copy_run(base_run, tmp_path / "run")
    _rewrite_part(run / "checkpoints" / "step-0000002", part, data)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=3"]) == 2
    line = one_error_line(capsys)
    assert expected in line and str(run / "checkpoints" / "step-0000002") in line


def test_untrusted_model_sizes_are_refused_before_allocation(base_run, tmp_path, capsys):
    assert (
        main(
            [
                "train",
                "--run-dir",
                str(tmp_path / "r"),
                *SETS,
                "--set",
                "model.vocab_size=1000000000000",
            ]
        )
        == 2
    )
    assert one_error_line(capsys).startswith(
        "error: model.vocab_size=1000000000000 (with model.n_embd=32, model.n_head=2) makes a "
        "model of 6.4e+13 parameters, more than the 1e+11 allowed; lower model.vocab_size"
    )
    # a checkpoint whose metadata claims such a model
    run = copy_run(base_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step-0000002"
    with safe_open(str(checkpoint / ckpt.MODEL_FILE), "pt") as handle:
        meta = handle.metadata()
    tensors = load_file(str(checkpoint / ckpt.MODEL_FILE))
    config = json.loads(meta["bdh_config"])
    config["vocab_size"] = 10**12
    meta["bdh_config"] = json.dumps(config)
    save_file(tensors, str(checkpoint / ckpt.MODEL_FILE), meta)
    ckpt.write_manifest(checkpoint)
    for command in (["generate", "--checkpoint", str(run)], ["eval", "--checkpoint", str(run)]):
        assert main(command) == 2
        line = one_error_line(capsys)
        assert line.startswith(f"error: the bdh_config metadata of {checkpoint / ckpt.MODEL_FILE}")
        assert "model.vocab_size=1000000000000" in line, line


def test_a_model_larger_than_memory_is_refused_before_allocation(monkeypatch):
    cfg = BDHConfig(n_layer=1, n_embd=32, n_head=2, mlp_internal_dim_multiplier=4)
    monkeypatch.setattr(bdh_module.os, "sysconf", lambda name: 1024 if "PAGES" in name else 64)
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 .* more than this machine's "):
        BDH(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position": "alibi_learned", "norm": "layernorm_affine", "vocab_size": 300},
        {
            "language_head": {
                "type": "nca_factorized_patch",
                "state_count": 2,
                "patch_size": 2,
                "frame_special_tokens": True,
            },
            "vocab_size": 40,
        },
    ],
    ids=["token", "alibi-learned-affine", "nca-head"],
)
def test_parameter_count_from_sizes_equals_the_built_model(overrides):
    cfg = BDHConfig.from_dict(
        {"n_layer": 2, "n_embd": 32, "n_head": 4, "mlp_internal_dim_multiplier": 4, **overrides}
    )
    assert cfg.parameter_count() == sum(p.numel() for p in BDH(cfg).parameters())


FILES = ("model.safetensors", "optimizer.pt")
"""A checkpoint's two largest files, in the order a save writes them."""


def test_file_size_limit_during_a_save_keeps_the_last_checkpoint(base_run, tmp_path):
    """EFBIG (ulimit -f) while writing optimizer.pt: one line naming the file and what to do;
    nothing half-written; the run resumes once the limit is lifted."""
    run = copy_run(base_run, tmp_path / "run")
    sizes = [(run / "checkpoints" / "step-0000002" / name).stat().st_size for name in FILES]
    assert sizes[0] < sizes[1]  # the weights fit under the limit, the optimizer's state does not
    limit = sum(sizes) // 2

    with start_process(
        cli_main,
        ["train", "--resume", str(run), "--set", "training.max_steps=4"],
        stdout=tmp_path / "limited.out",
        stderr=tmp_path / "limited.err",
        file_size_limit=limit,
    ) as proc:
        proc.join(120)
        stderr = (tmp_path / "limited.err").read_text()
        assert proc.exitcode == 2, stderr[-2000:]
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(
        f"error: cannot write {run / 'checkpoints' / 'step-0000004' / 'optimizer.pt'} ("
    ), stderr
    assert "enforce fail" not in stderr  # torch's C++ source location is left out
    assert stderr.strip().endswith(
        f"the last checkpoint, {run / 'checkpoints' / 'step-0000002'}, is intact: free space "
        "(or raise the file size limit, or make the directory writable), then continue with: "
        f"bdh-train train --resume {run}"
    )
    assert leftovers(run) == []
    assert ckpt.resolve_checkpoint(run).name == "step-0000002"
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=4"]) == 0
    assert ckpt.resolve_checkpoint(run).name == "step-0000004"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 512 KiB tmpfs (root only): a disk that really fills up and can be made read-only."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        reason = f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode})"
        print(reason)
        pytest.skip(reason)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_and_read_only_run_dir_keep_the_last_checkpoint(base_run, small_tmpfs, capsys):
    run = copy_run(base_run, small_tmpfs / "run")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=4"]) == 2
    line = one_error_line(capsys)
    assert "No space left on device" in line and str(run / "checkpoints") in line, line
    assert line.endswith(f"then continue with: bdh-train train --resume {run}"), line
    assert leftovers(run) == [] and ckpt.resolve_checkpoint(run).name == "step-0000002"

    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=4"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: Read-only file system: ") and str(run) in line, line
    assert ckpt.resolve_checkpoint(run).name == "step-0000002"

    subprocess.run(["mount", "-o", "remount,rw,size=4m", str(small_tmpfs)], check=True)
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=4"]) == 0
    assert ckpt.resolve_checkpoint(run).name == "step-0000004"


# ------------------------------------------------------------------ a signal to one rank
def _torchrun(run: Path, processes: int, *args: str) -> list[str]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        str(processes),
        "-m",
        "bdh_train",
        "train",
        "--run-dir",
        str(run),
        *args,
    ]


STOP_SETS = [
    *SETS,
    *set_args(
        [
            "training.max_steps=100000",
            "training.checkpoint_every=5",
            "training.gradient_accumulation_steps=2",
            "parallel.collective_timeout_s=20",
        ]
    ),
]
"""A run that trains until it is stopped, with checkpoints and accumulation windows."""


def assert_stopped_once(run: Path) -> int:
    """The run's newest checkpoint is the stop's: at the last logged step and its micro-step,
    the only one at that position, nothing half-written. -> the step it stopped at."""
    stopped = ckpt.resolve_checkpoint(run)
    state = ckpt.read_json(stopped / "trainer.json")
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert state["step"] == steps[-1]
    position = ckpt.checkpoint_position(stopped.name)
    assert position == (state["step"], state["micro"])
    same = [
        p
        for p in ckpt.list_checkpoints(run / "checkpoints")
        if ckpt.checkpoint_position(p.name) == position
    ]
    assert same == [stopped] and leftovers(run) == []
    return state["step"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigterm_to_one_data_parallel_rank_stops_both_with_one_checkpoint(tmp_path):
    """SIGTERM to rank 1 only of 2 data-parallel processes (forked by run_multiprocess, which
    makes their gloo group; `bdh-train train` runs in it with torchrun's rank variables): the
    stop is agreed at the next micro-step, both ranks write one checkpoint together and exit
    75, and `--resume` continues from it. The launch through torchrun, the group the command
    makes itself and its teardown are the mesh test's, below."""
    run, group = tmp_path / "run", tmp_path / "group"

    def stop_rank_1() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if (run / "checkpoints" / "latest").exists() and (group / "rank1.pid").exists():
                os.kill(int((group / "rank1.pid").read_text()), signal.SIGTERM)
                return
            time.sleep(0.1)

    stopper = threading.Thread(target=stop_rank_1, daemon=True)
    stopper.start()
    argv = ["train", "--run-dir", str(run), *STOP_SETS]
    assert run_multiprocess(cli_as_rank, group, argv, timeout=150) == [75, 75]
    stopper.join()
    target = assert_stopped_once(run) + 1
    argv = ["train", "--resume", str(run), "--set", f"training.max_steps={target}"]
    assert run_multiprocess(cli_as_rank, tmp_path / "resumed", argv, timeout=150) == [0, 0]
    assert ckpt.read_json(ckpt.resolve_checkpoint(run) / "trainer.json")["step"] == target


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigterm_to_one_rank_of_a_torchrun_mesh_stops_all_with_one_checkpoint(tmp_path):
    """`torchrun` of a 2 x 2 data x pipeline mesh, SIGTERM to rank 1 only: the stop is agreed
    at the next micro-step and every rank writes one checkpoint together and exits 75."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    mesh = ["parallel.pipeline_stages=2", "parallel.data_parallel=2", "parallel.microbatches=2"]
    launcher = subprocess.Popen(
        _torchrun(run, 4, *STOP_SETS, *set_args(mesh)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 150
        while not (run / "checkpoints" / "latest").exists():
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the mesh run did not start"
            time.sleep(0.2)
        workers = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(workers) == 4, workers
        ranks = {}
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1]
            ranks[int(rank)] = int(pid)
        os.kill(ranks[1], signal.SIGTERM)
        _, err = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    exits = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    # All ranks stop together (after the checkpoint's barrier); torchrun treats the first
    # exit (75, stopped) as a failure and sends SIGTERM to ranks that have not exited yet, so
    # those may report -15: their checkpoint work was already done (checked below).
    assert launcher.returncode != 0 and "75" in exits and set(exits) <= {"75", "-15"}, err[-3000:]
    assert_stopped_once(run)


# ------------------------------------------------------------------ SIGKILL loop
KILL_LOOP = [
    *MICRO,
    *STREAMING_TBPTT_SETTINGS,
    "training.checkpoint_every=1",
    "training.keep_checkpoints=2",
    "training.eval_every=10",
    "training.eval_steps=1",
    "training.max_steps=24",  # 6 segments advance <= 3 steps each before their kill
]


def _pointer(run: Path) -> str | None:
    try:
        return (run / "checkpoints" / "latest").read_text()
    except OSError:
        return None


KILLS = 6  # SIGKILLs at random moments, each followed by a resume


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_loop_resumes_bit_identical(tmp_path):
    """Six SIGKILLs at seeded random moments of a streaming TBPTT run with accumulation that
    checkpoints every step (so many land inside a save), each followed by --resume: the end
    is bit-identical to the uninterrupted run and no temporary directory is left. The runs
    are forked from a server that imported the package once (`helpers.start_process`: a
    fresh interpreter per run would spend most of the time importing torch)."""
    import random

    sets = [a for o in KILL_LOOP for a in ("--set", o)]
    whole, run = tmp_path / "whole", tmp_path / "run"

    with contextlib.ExitStack() as processes:  # each killed if alive and joined at the end

        def launch(argv: list[str]) -> multiprocessing.process.BaseProcess:
            command = ["train", *argv, *sets]
            return processes.enter_context(
                start_process(cli_main, command, stdout=Path(os.devnull))
            )

        started = time.monotonic()
        proc = launch(["--run-dir", str(whole)])
        proc.join(120)
        assert proc.exitcode == 0
        trained = [r for r in read_metrics(whole / "metrics.jsonl") if "elapsed_s" in r]
        step_s = trained[-1]["elapsed_s"] / len(trained)
        rng = random.Random(12)
        kills = inside_saves = 0
        while kills < KILLS:
            before = _pointer(run)
            proc = launch(["--resume", str(run)] if before else ["--run-dir", str(run)])
            deadline = time.monotonic() + 60
            while _pointer(run) == before and proc.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)  # until the first checkpoint of this segment
            time.sleep(rng.uniform(0.0, 2 * step_s))
            if not proc.is_alive():
                break
            proc.kill()
            proc.join(60)
            kills += 1
            inside_saves += bool(leftovers(run))
        proc.join(120)
        if kills == KILLS:
            proc = launch(["--resume", str(run)])
            proc.join(120)
        assert proc.exitcode == 0
    print(f"{kills} kills, {inside_saves} inside a save, {time.monotonic() - started:.1f} s")
    assert kills == KILLS
    assert_same_run(whole, run)
    assert leftovers(run) == []
