"""What a run tells its user: the start banner, the loss lines (pipe and terminal), the
compiling line, the end summary; and the run-level defaults behind them (the final step always
checkpoints, data.source stored absolute, resume with a changed or spent max_steps, empty eval)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import FRESH_BLOCKS, TEST_THREADS

from bdh_train.cli import main
from bdh_train.config import load_config
from bdh_train.data.sources import load_tokens
from bdh_train.errors import ConfigError, DataError
from bdh_train.model import BDH
from bdh_train.shared.threads import usable_cpus
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.run_dir import LOCK_FILE
from bdh_train.train import console
from bdh_train.train.config import TrainingConfig
from bdh_train.train.console import Progress, command_name, format_duration
from bdh_train.train.evaluate import evaluate
from bdh_train.train.metrics import read_metrics
from bdh_train.train.step import LanguageTrainModel
from bdh_train.training.trainer import Trainer

SMALL = [
    *FRESH_BLOCKS,  # the banner's recurrence line only where a test turns it on
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=1",
    "model.mlp_internal_dim_multiplier=2",
    "training.block_size=8",
    "training.batch_size=2",
    "training.max_steps=3",
    "training.log_every=2",
    "training.eval_every=3",
    "training.eval_steps=1",
    "training.checkpoint_every=0",
    "optimizer.warmup_steps=0",
    "optimizer.schedule='cosine'",
    "optimizer.min_lr=1e-4",
]


@pytest.mark.loss_plot
def test_a_cli_run_from_start_to_resume_in_other_directories(tmp_path, monkeypatch, capsys):
    """Banner, loss lines from the first step, final checkpoint with checkpoint_every = 0, the
    summary; then eval and --resume from another working directory (data.source is stored
    absolute); a resume with max_steps at the step is refused, one with more steps warns."""
    home, elsewhere, run = tmp_path / "home", tmp_path / "elsewhere", tmp_path / "run"
    home.mkdir()
    elsewhere.mkdir()
    (home / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    monkeypatch.chdir(home)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the banner's automatic count
    assert (
        main(
            [
                "train",
                "--set",
                "data.source='corpus.txt'",
                *sum((["--set", item] for item in SMALL), []),
                "--run-dir",
                str(run),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    cfg = load_config([run / "config.toml"], default_preset=False)
    assert cfg.data.source == str(home / "corpus.txt")  # stored absolute
    params = sum(p.numel() for p in BDH(cfg.model).parameters())
    data = load_tokens(home / "corpus.txt")
    train_split, val_split = data.split(0.1)  # the preset's val_fraction
    train_tokens, val_tokens = len(train_split), len(val_split)
    banner = [
        f"run directory  {run}",
        "device         cpu, float32 (dtype 'auto')",
        f"threads        {TEST_THREADS} (auto: {usable_cpus()} CPUs, 0.0 busy with other work; "
        f"torch's count {TEST_THREADS})",
        f"model          {params / 1e6:.2f} M parameters ({params:,})",
        f"data           {home / 'corpus.txt'}: {train_tokens:,} train tokens, "
        f"{val_tokens:,} val tokens",
        # eval_steps = 1 batch of 2 windows of 8 tokens, of the split's val_tokens - 1 targets
        f"validation     1 batch, 16 tokens ({16 / (val_tokens - 1):.1%} of the split, "
        "sampled across it), every 3 steps and at the end",
        "per step       2 x 8 tokens = 16 tokens",
        "length         3 steps (48 tokens in all)",
        # tests/train/test_throughput.py's hand count for 1 layer, D 16, 1 head, N 32, V 256,
        # T 8, dense: 2 * (3 * 6,016 - 256) = 35,584; the tests' constant peak (helpers)
        "throughput     35.6 kFLOP per token (a training step's, counted); peak 100 GFLOP/s "
        "(a 1024-square float32 product measured at start)",
        "config         layered on preset tiny (the default: no config file given)",
    ]
    lines = out.splitlines()
    assert lines[: len(banner)] == banner
    steps = [line.split(" | ")[0] for line in lines if line.startswith("step ")]
    assert steps == ["step 1/3", "step 2/3", "step 3/3", "step      3"]  # last: val_loss
    first = next(line for line in lines if line.startswith("step 1/3"))
    assert " | 16 tok | " in first and " tok/s | MFU " in first and "% | ETA " in first
    final = run / "checkpoints" / "step-0000003"
    assert ckpt.resolve_checkpoint(run) == final  # checkpoint_every = 0: still the final step
    summary = lines[-6:]
    assert summary[0].startswith("finished 3 steps, 48 tokens in ")
    command = command_name()  # bdh-train where it is on PATH (test_command_name)
    assert summary[1:] == [
        f"checkpoint     {final}",
        f"loss plot      {run / 'loss.png'}",
        f"train on       {command} train --resume {run} --set training.max_steps=6",
        f"generate       {command} generate --checkpoint {run} --prompt 'The '",
        f"evaluate       {command} eval --checkpoint {run}",
    ]
    assert (run / "loss.png").is_file()

    monkeypatch.chdir(elsewhere)  # the typed source 'corpus.txt' does not exist here
    assert main(["eval", "--checkpoint", str(run), "--batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] > 0
    assert main(["eval", "--checkpoint", str(run), "--batches", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --batches must be >= 1 (or left out for the whole split), got 0"]
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: training.max_steps = 3 is at or below the checkpoint's step 3: there is nothing "
        "left to train; to train on, set a larger value (e.g. --set training.max_steps=6)"
    ]
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=5"]) == 0
    out = capsys.readouterr().out
    old_lr, new_lr = cfg.optimizer.lr_at(3, 3), cfg.optimizer.lr_at(3, 5)
    assert f"{old_lr:.3g}" != f"{new_lr:.3g}"
    assert (
        "warning: training.max_steps changed from 3 (the checkpoint's) to 5: the cosine lr "
        f"schedule is re-stretched over the new length; the lr at step 3 jumps from "
        f"{old_lr:.3g} to {new_lr:.3g}"
    ) in out.splitlines()
    assert "length         steps 3 -> 5 (resumed) (80 tokens in all)" in out.splitlines()
    assert ckpt.resolve_checkpoint(run).name == "step-0000005"


def test_resume_with_the_same_length_gives_no_warning(tmp_path):
    cfg = load_config(overrides=[*SMALL, "training.max_steps=4", "training.eval_every=0"])
    Trainer(cfg, tmp_path, stream=io.StringIO()).run(stop_after_micro_steps=2)
    log = io.StringIO()
    Trainer(cfg, tmp_path, resume=True, stream=log).run()
    assert "resumed from" in log.getvalue() and "warning" not in log.getvalue()


def test_a_wsd_run_extended_from_its_stable_phase_keeps_its_lr(tmp_path):
    """A wsd run of 4 steps (its decay: the last one) stopped at step 2 and resumed with 8
    steps: the warning says where the decay moved and that the lr stays; steps 3-5 run at
    the base lr, the decay's first step (6) too, then it falls."""
    wsd = ["optimizer.schedule='wsd'", "optimizer.decay_fraction=0.25", "training.eval_every=0"]
    cfg = load_config(overrides=[*SMALL, *wsd, "training.max_steps=4", "training.log_every=1"])
    Trainer(cfg, tmp_path, stream=io.StringIO()).run(stop_after_micro_steps=2)
    longer = load_config(overrides=[*SMALL, *wsd, "training.max_steps=8", "training.log_every=1"])
    log = io.StringIO()
    Trainer(longer, tmp_path, resume=True, stream=log).run()
    base = cfg.optimizer.lr
    assert (
        "warning: training.max_steps changed from 4 (the checkpoint's) to 8: the wsd decay now "
        f"starts at step 6; the lr at step 2 stays {base:.3g}"
    ) in log.getvalue().splitlines()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    lrs = {row["step"]: row["lr"] for row in rows if "lr" in row}
    assert [lrs[s] for s in range(1, 8)] == [base] * 7 and lrs[8] < base


def test_the_compiling_line_comes_before_the_first_step_and_says_how_long(tmp_path, monkeypatch):
    monkeypatch.setattr(BDH, "compile_for_training", lambda self, mode: None)  # no compiler
    cfg = load_config(overrides=[*SMALL, "training.compile=true", "training.max_steps=1"])
    log = io.StringIO()
    Trainer(cfg, tmp_path, stream=log).run()
    lines = log.getvalue().splitlines()
    compiling = lines.index(
        "compiling the model (training.compile = 'auto'): the first step takes longer…"
    )
    took = next(i for i, line in enumerate(lines) if line.startswith("compiled: the first step"))
    first = next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))
    assert compiling < took < first or compiling < first < took
    assert lines[compiling - 1].startswith("config ")  # right after the banner


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def row(step: int, tokens_per_step: int = 100) -> dict:
    return {
        "step": step,
        "tokens": step * tokens_per_step,
        "loss": 2.0,
        "lr": 1e-3,
        "grad_norm": 0.5,
    }


def test_pipe_lines_come_at_the_first_step_every_log_every_and_every_heartbeat():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(1000, 0, out, log_every=100, heartbeat_s=30.0, clock=clock)
    for step in range(1, 101):
        clock.now = 10.0 * step  # 10 s a step
        progress.update(step, row(step))
    steps = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()]
    # the first step, then every 30 s (3 steps), and the log_every step
    assert steps == [
        1,
        4,
        7,
        10,
        13,
        16,
        19,
        22,
        25,
        28,
        31,
        34,
        37,
        40,
        43,
        46,
        49,
        52,
        55,
        58,
        61,
        64,
        67,
        70,
        73,
        76,
        79,
        82,
        85,
        88,
        91,
        94,
        97,
        100,
    ]
    first = out.getvalue().splitlines()[0]
    # 100 tokens in 10 s; 999 steps left at 10 s each
    assert first == (
        "step    1/1000 | loss 2.0000 | lr 1.00e-03 | grad_norm 0.500 | 100 tok | "
        f"10 tok/s | ETA {format_duration(9990)}"
    )
    assert format_duration(9990) == "2h46m"
    assert (format_duration(42), format_duration(185)) == ("42s", "3m05s")


def test_a_resumed_progress_counts_from_its_own_start():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(10, 4, out, log_every=0, initial_tokens=400, clock=clock)
    clock.now = 2.0
    progress.update(5, row(5))
    assert out.getvalue() == (
        "step  5/10 | loss 2.0000 | lr 1.00e-03 | grad_norm 0.500 | 500 tok | 50 tok/s | ETA 10s\n"
    )


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_loss_lines_are_written_above_the_bar():
    clock, out = FakeClock(), Terminal()
    progress = Progress(4, 0, out, log_every=2, heartbeat_s=0.0, clock=clock)
    assert progress.bar is not None
    for step in range(1, 5):
        clock.now = float(step)
        progress.update(step, row(step))
    progress.close()
    text = out.getvalue()
    # tqdm.write puts each line on its own, outside the bar's carriage-return redraws
    lines = [seg for line in text.split("\n") for seg in line.split("\r") if "| loss" in seg]
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == [
        "step 1/4",
        "step 2/4",
        "step 4/4",
    ]  # no heartbeat lines on a terminal: the bar moves instead
    assert "4/4" in text.split("\n")[-1] or "4/4" in text  # the bar itself reached the end


def test_a_stop_line_is_the_last_line_on_a_terminal_with_no_bar_below_it():
    clock, out = FakeClock(), Terminal()
    progress = Progress(10, 0, out, log_every=0, clock=clock)
    for step in range(1, 4):
        clock.now = float(step)
        progress.update(step, row(step))
    progress.stop("stopped at step 3 (+0 micro-steps); checkpoint c; continue with: r")
    text = out.getvalue()
    assert text.endswith("stopped at step 3 (+0 micro-steps); checkpoint c; continue with: r\n")
    assert "3/10" in text.rsplit("stopped at", 1)[0]  # the bar, left as it stood, above it


def test_an_evaluation_over_no_tokens_is_refused_not_zero():
    cfg = load_config(overrides=SMALL)
    model = BDH(cfg.model)
    data = load_tokens("builtin:pydoc")
    with pytest.raises(DataError, match="evaluation counted no tokens"):
        evaluate(LanguageTrainModel(model), data, 8, 2, 0)
    assert evaluate(LanguageTrainModel(model), data, 8, 2, 1).tokens > 0


def test_a_resume_past_the_end_is_refused_before_anything_is_written(tmp_path):
    cfg = load_config(overrides=[*SMALL, "training.max_steps=2", "training.eval_every=0"])
    Trainer(cfg, tmp_path, stream=io.StringIO()).run()

    def written() -> dict:  # the run's files; the lock file records each trainer that looks
        return {
            p: p.stat().st_mtime_ns
            for p in tmp_path.rglob("*")
            if p.is_file() and p.name != LOCK_FILE
        }

    before = written()
    cfg.training.max_steps = 1
    with pytest.raises(ConfigError, match="at or below the checkpoint's step 2"):
        Trainer(cfg, tmp_path, resume=True, stream=io.StringIO())
    assert written() == before
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-0000002"


def test_command_name_is_bdh_train_only_where_it_is_on_path(monkeypatch, tmp_path):
    """The closing hints name `bdh-train` when PATH has it, else `python -m bdh_train` (the
    interpreter's own path when `python` on PATH is another one)."""
    import sys

    found = {"bdh-train": None, "python": sys.executable}
    monkeypatch.setattr(console.shutil, "which", lambda name: found[name])
    assert command_name() == "python -m bdh_train"
    found["python"] = str(tmp_path / "python")  # another interpreter
    assert command_name() == f"{sys.executable} -m bdh_train"
    found["bdh-train"] = "/somewhere/bin/bdh-train"
    assert command_name() == "bdh-train"
    stop = console.stop_line(3, 0, tmp_path / "ckpt", tmp_path)
    assert stop.endswith(f"continue with: bdh-train train --resume {tmp_path}")


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ([], None),
        (
            ["training.tbptt_chunk_size=4"],
            "recurrence     TBPTT: backward through 1 chunk of 4 tokens at a time",
        ),
        (
            ["training.min_logical_block_size=16"],
            "recurrence     streaming: state carried across the blocks of 16-token documents",
        ),
        (
            [
                "training.tbptt_persist_across_steps=true",
                "training.tbptt_chunk_size=4",
                "training.tbptt_backprop_chunks=2",
            ],
            "recurrence     TBPTT: backward through 2 chunks of 4 tokens at a time; streaming: "
            "state carried from each step's block to the next",
        ),
    ],
)
def test_the_banner_says_when_tbptt_or_streaming_is_on(tmp_path, overrides, line):
    cfg = load_config(overrides=[*SMALL, *overrides])
    trainer = Trainer(cfg, tmp_path, stream=io.StringIO())
    try:
        lines = trainer.banner().lines()
    finally:
        trainer.close()
    found = [text for text in lines if text.startswith("recurrence")]
    assert found == ([] if line is None else [line])


def test_the_device_line_names_the_processes_mesh_sharding_and_precision():
    t, bf16 = TrainingConfig(), TrainingConfig(dtype="bfloat16")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert console.device_line(cpu, 1, (1, 1), False, t) == "cpu, float32"
    assert console.device_line(cuda, 4, (2, 2), False, bf16) == (
        "cuda x 4 processes (2 data-parallel x 2 pipeline stages), bfloat16 autocast"
    )
    assert console.device_line(cuda, 2, (2, 1), True, bf16) == (
        "cuda x 2 processes (FSDP: parameters, gradients and optimizer state sharded), "
        "bfloat16 autocast"
    )


def test_the_banner_says_how_much_of_the_split_an_evaluation_covers():
    """43 val tokens are 42 targets, 5 windows of 8: 16 tokens are 38.1% of the split, 40
    are all its windows."""
    t = TrainingConfig(block_size=8, batch_size=2, max_steps=3)

    def line(evaluation):
        data = console.RunData("src", 100, 43, evaluation=evaluation)
        start = console.RunStart("config.toml")
        lines = console.Banner(Path("run"), "cpu", 10, t, data, start).lines()
        return [text for text in lines if text.startswith("validation")]

    assert line((1, 16, 3)) == [
        "validation     1 batch, 16 tokens (38.1% of the split, sampled across it), every 3 "
        "steps and at the end"
    ]
    assert line((3, 40, 0)) == [
        "validation     3 batches, 40 tokens (the whole split), never (eval_every = 0)"
    ]
    assert line(None) == []
