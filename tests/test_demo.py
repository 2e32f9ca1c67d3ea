"""The demo's parts: the built-in Shakespeare corpus and `bdh-train corpus`, the evaluation
line in nats and bits per byte, the two end-of-run samples, and BDH_TRAIN_MAX_STEPS."""

from __future__ import annotations

import hashlib
import io
import math
from pathlib import Path

import pytest
from helpers import MICRO_RUN, assert_same_weights

from bdh_train.cli import main
from bdh_train.config import load_config
from bdh_train.data import builtin_corpus, load_tokens
from bdh_train.data.loaders import StreamingDocumentLoader
from bdh_train.errors import ConfigError
from bdh_train.evals import context as memory
from bdh_train.evals import recall
from bdh_train.storage.checkpoint import resolve_checkpoint
from bdh_train.storage.run_dir import RunDir
from bdh_train.train.console import command_name, eval_line, sample_lines
from bdh_train.train.evaluate import SAMPLE_TEMPERATURES, SAMPLE_TOKENS, sample_continuation
from bdh_train.train.metrics import read_metrics
from bdh_train.training.launch import steps_cap_note
from bdh_train.training.trainer import Trainer
from bdh_train.utils import STEPS_CAP_ENV, steps_cap

SHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"
"""Of Karpathy's tinyshakespeare input.txt (1,115,394 bytes), the text the package ships."""


def test_builtin_shakespeare_is_tinyshakespeare_byte_for_byte():
    text = builtin_corpus("shakespeare")
    raw = text.encode("utf-8")
    assert len(raw) == 1_115_394 and text.isascii()
    assert hashlib.md5(raw).hexdigest() == SHAKESPEARE_MD5  # noqa: S324 (a checksum, not security)
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    data = load_tokens("builtin:shakespeare")
    assert data.byte_level and len(data) == len(raw) and bytes(data.tokens[:5]) == b"First"


def test_the_demo_preset_trains_on_shakespeare():
    assert load_config().data.source == "builtin:shakespeare"


def test_corpus_lists_and_writes_the_builtins(tmp_path, capsys):
    assert main(["corpus"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == ["builtin:pydoc", "builtin:shakespeare"]
    out = tmp_path / "s.txt"
    assert main(["corpus", "builtin:shakespeare", "--out", str(out)]) == 0
    assert "1,115,394 bytes" in capsys.readouterr().out
    assert hashlib.md5(out.read_bytes()).hexdigest() == SHAKESPEARE_MD5  # noqa: S324
    out.write_text("mine")
    assert main(["corpus", "shakespeare", "--out", str(out)]) == 2  # an existing file is kept
    assert "exists; pass --force" in capsys.readouterr().err and out.read_text() == "mine"
    assert main(["corpus", "shakespeare", "--out", str(out), "--force"]) == 0
    assert out.stat().st_size == 1_115_394
    assert main(["corpus", "shakespear", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean 'shakespeare'" in capsys.readouterr().err
    assert main(["corpus", "pydoc"]) == 2
    assert "needs --out FILE" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.txt"]


def test_eval_line_gives_the_loss_per_byte_in_nats_and_bits():
    # 2 bits/byte = 2 ln 2 = 1.386294 nats/byte; a run of no text has only its loss per token
    assert eval_line(7, 1.5, 2.0) == (
        "step      7 | val_loss 1.5000 | 1.3863 nats/byte = 2.000 bits/byte"
    )
    assert eval_line(7, 1.5, None) == "step      7 | val_loss 1.5000"
    assert math.isclose(2.0 * math.log(2), 1.3862943611198906, rel_tol=1e-12)


def test_sample_lines_name_each_temperature_of_one_prompt():
    assert sample_lines("Ab", [(0.8, "x"), (0.5, "y")]) == (
        "--- sample at temperature 0.8 (prompt: 'Ab') ---\nx\n"
        "--- sample at temperature 0.5 (the same prompt) ---\ny\n---"
    )


def test_the_run_ends_with_a_sample_at_each_temperature(tmp_path):
    stream = io.StringIO()
    cfg = load_config(overrides=[*MICRO_RUN, "data.source=builtin:shakespeare"])
    trainer = Trainer(cfg, tmp_path / "run", stream=stream)
    # 32 tokens: the untrained model's logits are near flat, and its first 24 (seed 0) are
    # the same at both temperatures; from 32 on they differ
    first = trainer.sample(32)
    splits = (trainer.train_data, trainer.val_data)
    expected = [
        sample_continuation(
            trainer.model,
            trainer.tokenizer,
            cfg.model,
            cfg.data,
            splits,
            trainer.device,
            32,
            temperature=t,
        )
        for t in SAMPLE_TEMPERATURES
    ]
    assert SAMPLE_TEMPERATURES[1] < SAMPLE_TEMPERATURES[0]
    assert first == expected[0][1] and expected[0][1] != expected[1][1]
    pairs = [(t, e[1]) for t, e in zip(SAMPLE_TEMPERATURES, expected, strict=True)]
    assert sample_lines(expected[0][0], pairs) in stream.getvalue()


@pytest.mark.parametrize(("value", "cap"), [(None, None), ("", None), ("3", 3), (" 12 ", 12)])
def test_steps_cap_reads_a_positive_integer(value, cap):
    assert steps_cap({} if value is None else {STEPS_CAP_ENV: value}) == cap


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_steps_cap_refuses_anything_else(value):
    with pytest.raises(ConfigError, match=f"{STEPS_CAP_ENV} must be a positive integer"):
        steps_cap({STEPS_CAP_ENV: value})


def test_the_steps_cap_ends_the_command_and_the_run_keeps_its_length(tmp_path, monkeypatch, capsys):
    """BDH_TRAIN_MAX_STEPS=2 ends each command 2 steps past its start, checkpointed and
    evaluated (2 batches) as a run's end, on the run's own schedule; the run keeps
    training.max_steps = 6, so a plain --resume trains on to it: 2 + 2 capped steps and 2
    uncapped end with the weights and rows of the 6 steps trained at once."""
    sets = [
        *MICRO_RUN,
        "training.max_steps=6",
        "training.eval_every=100",  # only a command's last step
        "training.eval_steps=4",
        "training.log_every=1",
        "training.checkpoint_every=0",
    ]
    argv = [arg for s in sets for arg in ("--set", s)]
    monkeypatch.delenv(STEPS_CAP_ENV, raising=False)
    assert steps_cap_note(load_config(overrides=sets)) is None
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert main(["train", "--run-dir", str(whole), *argv]) == 0
    monkeypatch.setenv(STEPS_CAP_ENV, "2")
    assert main(["train", "--run-dir", str(run), *argv]) == 0
    out, err = capsys.readouterr()
    assert "this command ends at most 2 steps past where it starts and evaluates at most 2" in err
    assert "the run keeps training.max_steps = 6 and its schedule" in err
    assert "validation     2 batches," in out and "step 2/2 |" in out
    assert f"train on       bdh-train train --resume {run}\n" in out.replace(
        command_name(), "bdh-train"
    )
    assert "max_steps = 6" in (run / "config.toml").read_text()
    assert [c.name for c in (run / "checkpoints").glob("step-*")] == ["step-0000002"]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "val_loss" in r] == [2]  # the command's end, evaluated
    assert main(["train", "--resume", str(run)]) == 0
    assert "max_steps changed" not in capsys.readouterr().err
    monkeypatch.delenv(STEPS_CAP_ENV)
    assert main(["train", "--resume", str(run)]) == 0
    assert resolve_checkpoint(run).name == "step-0000006"
    assert_same_weights(whole, run)
    lr = [[r["lr"] for r in read_metrics(r / "metrics.jsonl") if "loss" in r] for r in (whole, run)]
    assert lr[0] == lr[1] and len(lr[0]) == 6


def test_make_demo_trains_into_the_run_directory_the_readme_names(tmp_path):
    """`make demo` writes runs/demo, the directory of the README's demo output; a second
    `make demo` meets the run-directory rule (refused, never cleared)."""
    import shutil
    import subprocess
    from pathlib import Path

    from bdh_train.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine: the Makefile's recipe cannot be expanded")
    recipe = subprocess.run(
        [make, "-n", "--no-print-directory", "-o", ".venv/.installed", "demo"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert Path(recipe[0]).name == "bdh-train"
    args = build_parser().parse_args(recipe[1:])
    assert args.command == "train" and args.run_dir == "runs/demo" and not args.overwrite
    readme = (root / "README.md").read_text()
    assert "\nrun directory  runs/demo\n" in readme
    assert "bdh-train generate --checkpoint runs/demo" in readme
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("")
    with pytest.raises(ConfigError, match="already holds a run"):
        RunDir(run).check_fresh(overwrite=args.overwrite)


@pytest.mark.run_end
def test_a_run_on_mqar_ends_with_its_recall_not_a_context_curve(tmp_path):
    """MQAR's validation split is independent examples back to back: the run's last line is
    the recall of its trained pairs at 1, 2 and 4 times its trained length (64 examples of
    seed data.mqar.seed + 1 with the generator's settings, as `eval --recall` reads them),
    read in eval mode (dropout off) and the model left in training mode; not the state
    gain."""
    stream = io.StringIO()
    mqar = ["data.source='mqar'", "data.mqar.pairs=4", "data.mqar.length=32"]
    generator = ["data.mqar.examples=64", "data.mqar.power_a=0.5", "data.mqar.random_fill=false"]
    steps = ["training.max_steps=1", "training.eval_every=0", "training.checkpoint_every=0"]
    overrides = [*MICRO_RUN, *mqar, *generator, *steps, "model.dropout=0.5"]
    trainer = Trainer(load_config(overrides=overrides), tmp_path / "run", stream=stream)
    trainer.run()
    assert trainer.model.training
    line = trainer.state_gain()
    assert trainer.model.training
    trainer.model.eval()
    scorer = recall.model_scorer(trainer.model, trainer.cfg.training.batch_size)
    seed = trainer.cfg.data.mqar.seed + 1
    grid = recall.recall_grid(scorer, [4], [32, 64, 128], 256, 64, seed, 0.5, 32, False)
    assert line is not None and line.startswith(f"recall         {grid.accuracy[0][0]:.3f} of 4")
    assert line == grid.run_end_line() and line in stream.getvalue()
    assert "(the trained length)" in line and "state gain" not in stream.getvalue()


@pytest.mark.run_end
def test_the_run_ends_with_what_the_state_gained(tmp_path):
    """The end-of-run line is the last bucket of the context curve over the validation split,
    32 blocks per stretch, 4 stretches; none when the split holds less than one stretch."""
    assert Trainer.end_sample_tokens == SAMPLE_TOKENS == 200  # a user's run end (the marker)
    stream = io.StringIO()
    steps = ["training.max_steps=1", "training.eval_every=0", "training.checkpoint_every=0"]
    cfg = load_config(overrides=[*MICRO_RUN, *steps, "data.source=builtin:shakespeare"])
    trainer = Trainer(cfg, tmp_path / "run", stream=stream)
    trainer.run()
    assert trainer.val_data is not None
    block, batch = cfg.training.block_size, cfg.training.batch_size
    trainer.model.eval()
    val = trainer.val_data.tokens
    curve = memory.context_curve(trainer.model, val, block, 32 * block, 4, batch)
    line = curve.last_bucket_line()
    assert line.startswith(f"state gain     {curve.blocks[-1] - curve.carried[-1]:+.4f} ")
    assert trainer.state_gain() == line and line in stream.getvalue()
    text = tmp_path / "short.txt"
    text.write_text("to be or not to be " * 200)  # 3,800 bytes: a validation split of 380
    short = load_config(overrides=[*MICRO_RUN, f"data.source={text}"])
    assert Trainer(short, tmp_path / "short", stream=io.StringIO()).state_gain() is None


@pytest.mark.run_end
def test_the_state_recipe_streams_a_decayed_state(tmp_path):
    """configs/state.toml: the tiny preset with alibi_spread's decay, trained on 1,024-token
    documents whose blocks carry the state from step to step; a short run of it carries a
    state out of its last step and ends with the state-gain line."""
    recipe = Path(__file__).parents[1] / "configs" / "state.toml"
    steps = ["training.max_steps=2", "training.eval_every=0", "training.checkpoint_every=0"]
    cfg = load_config([recipe], overrides=[*MICRO_RUN, *steps, "data.source=builtin:shakespeare"])
    assert cfg.model.position == "alibi_spread" and cfg.training.streaming
    assert cfg.training.logical_block_size == 1024
    stream = io.StringIO()
    trainer = Trainer(cfg, tmp_path / "run", stream=stream)
    assert isinstance(trainer.loader, StreamingDocumentLoader)
    trainer.run()
    carried = trainer.executor.carried_state
    assert carried is not None and all(rho is not None for rho in carried.rho)
    assert "streaming: state carried across the blocks of 1024-token documents" in (
        stream.getvalue()
    )
    assert "state gain     " in stream.getvalue()
