"""What an operator meets when things go wrong: a damaged latest checkpoint, I/O failures
(file size limit, read-only directory), untrusted sizes, corrupt checkpoint parts, a signal
to one DDP rank, and SIGKILLs at random points. Every user-facing failure is one `error:`
line and exit status 2, and the last checkpoint stays intact and resumable."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from bdh_train.cli import main
from bdh_train.train import checkpoint as ckpt
from bdh_train.train.metrics import read_metrics

MICRO = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.mlp_internal_dim_multiplier=4",
    "training.block_size=16",
    "training.batch_size=4",
    "training.log_every=1",
    "training.eval_every=0",
    "training.checkpoint_every=2",
    "training.keep_checkpoints=0",
    "training.max_steps=4",
]
SETS = [a for o in MICRO for a in ("--set", o)]
DETERMINISTIC = ("step", "tokens", "loss", "lr", "grad_norm", "val_loss", "bits_per_byte")


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.resolve_checkpoint(run_dir) / ckpt.MODEL_FILE))


def metric_rows(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k in DETERMINISTIC}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert metric_rows(a) == metric_rows(b)


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
        "step-0000002", "step-0000003"
    ]
    damaged = run / "checkpoints" / "step-0000003" / ckpt.MODEL_FILE
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    capsys.readouterr()

    assert main(["train", "--resume", str(run), "--set", "training.max_steps=4"]) == 2
    line = one_error_line(capsys)
    assert "SHA-256" in line and "step-0000002" in line and "--resume-fallback" in line

    assert main(
        ["train", "--resume", str(run), "--resume-fallback", "--set", "training.max_steps=4"]
    ) == 0
    assert "resumed from " + str(run / "checkpoints" / "step-0000002") in capsys.readouterr().out
    assert_same_run(whole, run)
