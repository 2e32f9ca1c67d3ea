"""The command line as a user meets it: the default run, generate/eval on its
checkpoint, and every bad input answered with one message, exit status 2, and nothing in the
run directory but the error log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MICRO

from bdh_train.cli import main
from bdh_train.data import write_token_file


def run_cli(*args: str, cap: int | None = None) -> subprocess.CompletedProcess:
    """The `bdh-train` script with `args`; `cap`: BDH_TRAIN_MAX_STEPS in its environment."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cap is not None:
        env["BDH_TRAIN_MAX_STEPS"] = str(cap)
    return subprocess.run(
        [str(Path(sys.executable).with_name("bdh-train")), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.slow
def test_default_train_then_generate_and_eval(tmp_path, capsys):
    """The `bdh-train` script on the default config, shortened by BDH_TRAIN_MAX_STEPS=3 (3
    steps, evaluations of 3 batches), then generate and eval on the run it wrote (in this
    process: the script's start-up was shown once)."""
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--run-dir", str(run_dir), "--set", "training.log_every=1", cap=3)
    assert proc.returncode == 0, proc.stderr
    assert "--- sample" in proc.stdout
    for name in ("config.toml", "metrics.jsonl", "loss.png", "checkpoints/latest"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "checkpoints/step-0000003/model.safetensors").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert set(train_rows[0]) == {
        "step",
        "tokens",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "elapsed_s",
    }
    # the MFU of each row's rate: the counted FLOPs per token over the measured peak
    assert train_rows[0]["mfu"] > 0
    assert any("val_loss" in r and "bits_per_byte" in r for r in rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]

    capsys.readouterr()
    generate = ["generate", "--checkpoint", str(run_dir), "--prompt", "def "]
    assert main([*generate, "--max-new-tokens", "20", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.encode()) >= 20

    assert main(["eval", "--checkpoint", str(run_dir), "--batches", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["val_loss"] > 0
    assert abs(result["bits_per_byte"] - result["val_loss"] / np.log(2)) < 1e-9


def test_generate_is_deterministic_for_a_seed(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path), *MICRO]) == 0
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(tmp_path), "--max-new-tokens", "12", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_config_show_prints_the_resolved_config(capsys):
    assert main(["config", "--set", "training.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "max_steps = 7" in out and "[model]" in out and 'source = "builtin:shakespeare"' in out


def test_plan_prints_timeline_and_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert (
        main(["plan", "--layers", "4", "--stages", "2", "--microbatches", "4", "--png", str(png)])
        == 0
    )
    out = capsys.readouterr().out
    assert "stage 0  F0 F1 F2 F3 .  .  B0 B1 B2 B3" in out
    assert "bubble fraction: 0.200" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_png_replaces_a_file_only_with_force_and_never_a_fifo(tmp_path, capsys):
    """--png under the output policy: an existing file is refused (left as it was) unless
    --force; a FIFO is refused even with --force, before anything is drawn."""
    import os

    args = ["plan", "--layers", "4", "--stages", "2", "--microbatches", "4", "--png"]
    png, fifo = tmp_path / "mine.png", tmp_path / "pipe"
    png.write_bytes(b"mine")
    os.mkfifo(fifo)
    assert main([*args, str(png)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and png.read_bytes() == b"mine"
    assert main([*args, str(fifo), "--force"]) == 2
    assert "FIFO" in capsys.readouterr().err and fifo.exists()
    assert main([*args, str(png), "--force"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_shows_the_data_parallel_by_pipeline_mesh(capsys):
    args = ["plan", "--layers", "4", "--stages", "2", "--microbatches", "2"]
    assert main([*args, "--data-parallel", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        "mesh: 3 data-parallel x 2 pipeline stages = 6 processes (torchrun --nproc-per-node "
        "6, or that many in all)",
        "  replica 0: ranks 0 1 (stages 0..1)",
        "  replica 1: ranks 2 3 (stages 0..1)",
        "  replica 2: ranks 4 5 (stages 0..1)",
    ]


def test_profile_shows_where_the_time_goes(tmp_path, capsys):
    """From metrics.jsonl profile rows (written here by hand, as a CUDA run with detail
    probes would): the mean of each part in ms and its share of the whole step, the rest of the
    step as 'other', the probes, in-use and reserved memory; and the stacked bar PNG."""
    rows = [{"step": 1, "loss": 5.0}]  # a row without a profile is skipped
    for step, forward in ((1, 0.010), (2, 0.030)):
        rows.append(
            {
                "step": step,
                "loss": 4.0,
                "forward_s": forward,
                "backward_s": 0.040,
                "probe_embed_s": 0.001,
                "probe_model_forward_s": 0.004,
                "step_s": 0.100,
                "mem_before_mib": 100.0,
                "mem_before_reserved_mib": 128.0,
                "mem_after_forward_mib": 300.0,
                "mem_after_forward_reserved_mib": 512.0,
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["profile", str(tmp_path)]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "profile: mean optimizer step over 2 optimizer steps" in lines[0]
    assert "forward 20.00 20.0%" in lines
    assert "backward 40.00 40.0%" in lines
    assert "detail probes 5.00 5.0%" in lines
    assert "other (data, accumulation, optimizer) 35.00 35.0%" in lines
    assert "whole step 100.00 100.0%" in lines
    assert "embedding (+backward) 1.00" in lines and "whole model forward 4.00" in lines
    assert "before the step 100.0 128.0" in lines and "after forward 300.0 512.0" in lines
    assert any("CUDA allocated" in line for line in lines)
    assert lines[-1] == str(tmp_path / "profile.png")
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_of_a_run_without_profile_rows_says_how_to_get_them(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    assert main(["profile", str(tmp_path)]) == 2
    assert "train with training.profile = 'step' or 'detail'" in capsys.readouterr().err
    assert main(["profile", str(tmp_path / "nowhere")]) == 2
    assert "is " in capsys.readouterr().err and not (tmp_path / "profile.png").exists()


def test_plan_bad_argument_names_the_field(capsys):
    assert main(["plan", "--layers", "2", "--stages", "4", "--microbatches", "4"]) == 2
    assert "model.n_layer" in capsys.readouterr().err


# ---------------------------------------------------------------- bad input
def _bad_sources(tmp_path: Path) -> dict[str, tuple[str, str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    big_ids = tmp_path / "ids.bin"
    write_token_file(big_ids, np.array([1, 2, 300, 4] * 50), vocab_size=512)
    no_txt = tmp_path / "no_txt"
    no_txt.mkdir()
    return {
        "missing": (str(tmp_path / "nope.txt"), "does not exist"),
        "empty": (str(empty), "is empty"),
        "short": (str(short), "fewer than"),
        "ids": (str(big_ids), "300"),
        "no-txt-dir": (str(no_txt), "contains no corpus files"),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "short", "ids", "no-txt-dir"])
def test_bad_data_is_one_message_and_nothing_written(tmp_path, capsys, case):
    source, expected = _bad_sources(tmp_path)[case]
    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), *MICRO, "--set", f"data.source='{source}'"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1
    assert "Traceback" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["error.log"]


def test_a_cpu_compile_without_a_cpp_compiler_is_one_message_and_nothing_written(tmp_path, capsys):
    """Inductor builds its CPU kernels with a C++ compiler: none found refuses the run before
    anything is written (here its search list names a compiler that does not exist; torch's
    own patch, which monkeypatch's undo would break for later compiles)."""
    import torch._inductor.config

    run_dir = tmp_path / "run"
    with torch._inductor.config.patch({"cpp.cxx": ("no-such-cxx-compiler",)}):
        code = main(["train", "--run-dir", str(run_dir), *MICRO, "--set", "training.compile=true"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(
        "error: training.compile = 'auto' builds C++ kernels on the CPU, but torch's inductor "
        "found no C++ compiler (No working C++ compiler found in "
    )
    assert err.rstrip().endswith("or set training.compile = false")
    assert sorted(p.name for p in run_dir.iterdir()) == ["error.log"]
    eager = ["train", "--run-dir", str(tmp_path / "eager"), *MICRO, "--set", "training.max_steps=1"]
    assert main(eager) == 0  # an eager run needs no compiler


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.blok_size=3", "unknown key training.blok_size (did you mean 'block_size'?)"),
        ("training.block_size=-3", "training.block_size must be a positive integer, got -3"),
        ("model.position=sinusoidal", "model.position must be one of 'rope', 'alibi'"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("training.tbptt_backprop_chunks=0", "training.tbptt_backprop_chunks must be a positive"),
    ],
)
def test_bad_config_is_one_message_and_nothing_written(tmp_path, capsys, override, expected):
    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), *MICRO, "--set", override]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["error.log"]
    assert expected in (run_dir / "error.log").read_text()


def test_bad_toml_file_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nblock_size = = 3\n")
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "line 2" in err


def test_resume_into_an_incompatible_model_is_refused(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path), *MICRO]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    code = main(
        [
            "train",
            "--resume",
            str(tmp_path),
            "--set",
            "model.n_embd=64",
            "--set",
            "training.max_steps=6",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    # refused before the checkpoint is read: a resume keeps the model (config.RESUME_FIXED)
    assert err.startswith("error: model.n_embd is 32 in the run's config") and "64 here" in err
    assert "checkpoint.init_from" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_generate_from_missing_checkpoint(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.loss_plot
def test_plot_redraws_loss_png(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path), *MICRO]) == 0
    (tmp_path / "loss.png").unlink()
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def _metrics_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_of_several_runs_draws_them_on_one_chart(tmp_path, capsys, monkeypatch):
    """Two runs of 100 and 200 tokens a step: their train losses as lines and validation
    losses as dots, against steps or tokens; a validation row (no token count) at a step the
    train rows skip sits at the tokens read off its neighbours (step 3 of the first: between
    200 at step 2 and 400 at step 4, 300). Same-named runs are labelled by their paths."""
    from matplotlib.axes import Axes

    a = _metrics_run(
        tmp_path / "a" / "run",
        [
            {"step": 1, "tokens": 100, "loss": 5.0},
            {"step": 2, "tokens": 200, "loss": 4.0},
            {"step": 3, "val_loss": 3.9},
            {"step": 4, "tokens": 400, "loss": 3.0},
        ],
    )
    b = _metrics_run(
        tmp_path / "b" / "run",
        [{"step": 1, "tokens": 200, "loss": 4.5}, {"step": 2, "tokens": 400, "loss": 3.5}],
    )
    drawn = []
    real_plot = Axes.plot

    def record(self, xs, ys, *rest, label=None, **kwargs):
        drawn.append((label, list(xs), list(ys)))
        return real_plot(self, xs, ys, *rest, label=label, **kwargs)

    monkeypatch.setattr(Axes, "plot", record)
    png = tmp_path / "both.png"
    assert main(["plot", str(a), str(b), "--png", str(png), "--x", "tokens"]) == 0
    assert capsys.readouterr().out == f"{png}\n" and png.read_bytes()[:4] == b"\x89PNG"
    assert drawn == [
        (str(a), [100.0, 200.0, 400.0], [5.0, 4.0, 3.0]),
        (f"{a} (validation)", [300.0], [3.9]),
        (str(b), [200.0, 400.0], [4.5, 3.5]),
    ]
    drawn.clear()
    renamed = b.rename(tmp_path / "b" / "other")
    assert main(["plot", str(a), str(renamed), "--png", str(png), "--force"]) == 0
    assert [(label, xs) for label, xs, _ in drawn] == [
        ("run", [1.0, 2.0, 4.0]),
        ("run (validation)", [3.0]),
        ("other", [1.0, 2.0]),
    ]
    capsys.readouterr()
    refusals = [
        ([str(a), str(renamed)], "plot of 2 runs draws one chart of its own: give --png PATH"),
        ([str(a), "--x", "tokens"], "plot of --x tokens draws one chart of its own"),
        ([str(a), "--png", str(png)], "already exists; pass --force"),
        ([str(a), "--png", str(png), "--x", "token", "--force"], "--x must be one of"),
        ([str(a), str(tmp_path), "--png", str(tmp_path / "c.png")], "a run directory?"),
    ]
    merged = _metrics_run(tmp_path / "merged", [{"step": 1, "loss": 4.0}])  # no tokens
    empty = _metrics_run(tmp_path / "empty", [{"step": 1, "tokens_per_s": 9.0}])
    c = str(tmp_path / "c.png")
    refusals += [
        ([str(a), str(merged), "--png", c, "--x", "tokens"], "hold no training tokens"),
        ([str(a), str(empty), "--png", c], f"{empty}: its metrics.jsonl holds no loss to draw"),
    ]
    for argv, message in refusals:
        assert main(["plot", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "c.png").exists()
    assert main(["plot", str(a), str(merged), "--png", c]) == 0  # by step, rows without tokens


def test_export_ternary_of_a_bitnet_run(tmp_path, capsys):
    import torch

    from bdh_train.storage.ternary import load_ternary

    bitnet = Path(__file__).parents[2] / "configs" / "bitnet.toml"
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--run-dir",
                str(run_dir),
                "--config",
                str(bitnet),
                *MICRO,
                "--set",
                "model.quant.warmup_steps=0",
            ]
        )
        == 0
    )
    out = tmp_path / "model.safetensors"
    assert main(["export", "--ternary", str(run_dir), str(out)]) == 0
    again = tmp_path / "again.safetensors"  # RUN given as generate and eval take it
    assert main(["export", "--ternary", "--checkpoint", str(run_dir), str(again)]) == 0
    from safetensors.torch import load_file

    packed_again, packed_first = load_file(again), load_file(out)
    assert packed_again.keys() == packed_first.keys()
    assert all(torch.equal(packed_again[k], packed_first[k]) for k in packed_first)
    again.unlink()
    capsys.readouterr()
    from bdh_train import load_run

    fake_quant, _, _ = load_run(run_dir)
    packed = load_ternary(out)
    idx = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(packed(idx)[0], fake_quant(idx)[0], rtol=1e-5, atol=1e-5)
    # generate and load_run read the export as well as the run (greedy: the same text)
    from_export, tok, _ = load_run(out, device="cpu")
    assert tok is not None and from_export.quantizer is not None
    greedy = ["--prompt", "def ", "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]
    assert main(["generate", "--checkpoint", str(out), *greedy]) == 0
    text_from_export = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(run_dir), *greedy]) == 0
    assert text_from_export.startswith("def ") and len(text_from_export) > len("def \n")
    assert text_from_export == capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(out)]) == 2  # an export holds no data settings
    assert "pass --data SOURCE" in capsys.readouterr().err
    text = tmp_path / "held_out.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    assert main(["eval", "--checkpoint", str(out), "--data", str(text), "--batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] > 0
    # an export is never written into the checkpoint it reads (it would damage it) nor as
    # a directory, and either refusal leaves the files as they were
    from bdh_train.storage.checkpoint import resolve_checkpoint

    checkpoint = resolve_checkpoint(run_dir)
    weights = checkpoint / "model.safetensors"
    before = weights.read_bytes()
    for inside in (weights, checkpoint, checkpoint / "sub" / "x.safetensors"):
        assert main(["export", "--ternary", str(run_dir), str(inside)]) == 2
        assert capsys.readouterr().err == (
            f"error: OUT {inside} is inside {run_dir / 'checkpoints'}, the checkpoints it "
            "exports from, which it would damage; write the export outside it\n"
        )
    assert weights.read_bytes() == before and not (checkpoint / "sub").exists()
    assert main(["export", "--ternary", str(run_dir), str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: OUT {tmp_path} is a directory, not a file: choose another path\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run", out.name, text.name])
    assert main(["generate", "--checkpoint", str(run_dir), *greedy]) == 0  # still intact


def test_export_of_a_float_run_is_refused(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path), *MICRO]) == 0
    capsys.readouterr()
    assert main(["export", "--ternary", str(tmp_path), str(tmp_path / "x.safetensors")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("ending", ["finished", "failed"])
def test_train_frees_its_trainer_before_the_process_group_goes(
    tmp_path, monkeypatch, ending, single_process_group
):
    """The Trainer sits in reference cycles and its wrapped model holds the process group:
    `bdh-train train` in a process with a group frees it (cycles collected) before
    destroying the group, not at interpreter shutdown, also when the run ends in an error
    (whose traceback holds the trainer's frames). Checked with the cycle collector off,
    when the group is closed."""
    import gc
    import weakref

    from bdh_train.distributed.env import DistContext
    from bdh_train.errors import DataError
    from bdh_train.training import trainer as trainer_module

    made: list[weakref.ref] = []
    freed_at_close: list[bool] = []
    build, run = trainer_module.Trainer.__init__, trainer_module.Trainer.run
    close = DistContext.close

    def recording_init(self, *args, **kwargs):
        made.append(weakref.ref(self))
        build(self, *args, **kwargs)

    def run_then_fail(self):
        run(self)
        raise DataError("the disk is full (a stand-in)")

    def recording_close(self):
        freed_at_close.append(made[0]() is None)
        close(self)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", recording_init)
    if ending == "failed":
        monkeypatch.setattr(trainer_module.Trainer, "run", run_then_fail)
    monkeypatch.setattr(DistContext, "close", recording_close)
    one_step = [
        "--set",
        "training.max_steps=1",
        "--set",
        "training.eval_every=0",
        "--set",
        "training.checkpoint_every=1",
    ]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        code = main(["train", "--run-dir", str(tmp_path / "run"), *MICRO, *one_step])
        assert code == (0 if ending == "finished" else 2)
        assert len(made) == 1 and freed_at_close == [True]
    finally:
        if was_enabled:
            gc.enable()
