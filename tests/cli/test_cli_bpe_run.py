"""A run trained with a BPE tokenizer carries it: the tokenizer.json is in the run directory,
every checkpoint (under the manifest) and the ternary export, and generate, eval, load_run and
the end-of-run sample decode with it with no flag. model.vocab_size follows the tokenizer; a
contradicting one is one line and no run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import BPE_TEXT, MICRO, bpe_corpus

import bdh_train
from bdh_train.cli import main
from bdh_train.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from bdh_train.model import sampling
from bdh_train.storage.checkpoint import MANIFEST
from bdh_train.storage.ternary import export_tokenizer_json

SMALL = [*MICRO, "--set", "model.n_layer=1", "--set", "training.checkpoint_every=2"]
GREEDY = ["--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """(run directory, tokenizer, .bin data, ternary export, the training console) of a
    3-step BitNet run on BPE token data; the config never sets model.vocab_size."""
    from pathlib import Path

    root = tmp_path_factory.mktemp("bpe")
    tok, tok_path, data = bpe_corpus(root / "corpus")
    bitnet = Path(__file__).parents[2] / "configs" / "bitnet.toml"
    run_dir = root / "run"
    args = [
        "train",
        "--run-dir",
        str(run_dir),
        "--config",
        str(bitnet),
        *SMALL,
        "--set",
        "model.quant.warmup_steps=0",
        "--set",
        f"data.source='{data}'",
        "--set",
        f"data.tokenizer='{tok_path}'",
    ]
    import contextlib
    import io

    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        assert main(args) == 0  # a short sample (suite_setup.py): a BitNet token costs ~0.1 s
    export = root / "model.ternary.safetensors"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", "--ternary", str(run_dir), str(export)]) == 0
    return run_dir, tok, data, export, console.getvalue()


def test_the_tokenizer_travels_with_the_run(bpe_run):
    run_dir, tok, _, export, _ = bpe_run
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [c.name for c in checkpoints] == ["step-0000002", "step-0000003"]
    for where in [run_dir, *checkpoints]:
        copy = load_tokenizer(where / TOKENIZER_FILE)
        assert copy.fingerprint() == tok.fingerprint(), where
    for checkpoint in checkpoints:  # the manifest guards the copy like every other file
        assert TOKENIZER_FILE in json.loads((checkpoint / MANIFEST).read_text())["files"]
    assert export_tokenizer_json(export) == tok.to_json()
    config = (run_dir / "config.toml").read_text()
    assert f'tokenizer = "{(run_dir / TOKENIZER_FILE).resolve()}"' in config  # its own copy
    assert f"vocab_size = {tok.vocab_size}" in config  # followed the tokenizer


def test_generate_and_eval_decode_with_the_run_tokenizer(bpe_run, capsys):
    run_dir, tok, data, export, console = bpe_run
    model, loaded, cfg = bdh_train.load_run(run_dir)
    assert loaded.fingerprint() == tok.fingerprint() and cfg.model.vocab_size == tok.vocab_size
    prompt = "ROMEO 3: the quick"
    ids = torch.tensor(tok.encode(prompt))
    expected = (
        prompt + tok.decode(sampling.generate(model, ids, 8, temperature=0)[len(ids) :]) + "\n"
    )
    for checkpoint in (run_dir, export):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompt, *GREEDY]) == 0
        assert capsys.readouterr().out == expected, checkpoint
    assert main(["eval", "--checkpoint", str(run_dir), "--device", "cpu"]) == 0
    row = json.loads(capsys.readouterr().out)
    # bits per byte of the BPE text: fewer bytes than tokens would give a larger number
    assert row["bits_per_byte"] < row["val_loss"] / 0.6931471805599453
    assert main(["eval", "--checkpoint", str(export), "--data", str(data), "--batches", "2"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"val_loss", "bits_per_byte", "tokens"}
    assert f"({tok.vocab_size} ids)" in console.split("tokenizer      ")[1].splitlines()[0]
    # the end-of-run sample: the first tokens of the validation split, decoded with the BPE
    sample = console.split("--- sample at temperature 0.8 (prompt: ")[1].split(") ---")[0]
    assert eval(sample) in BPE_TEXT and len(eval(sample)) > 32  # noqa: S307 (a repr we wrote)


def test_a_moved_run_loads_with_its_checkpoint_copy(bpe_run, tmp_path):
    run_dir, tok, _, _, _ = bpe_run
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    (moved / TOKENIZER_FILE).unlink()  # only the checkpoint's copy is left
    model, loaded, cfg = bdh_train.load_run(moved)
    latest = moved / "checkpoints" / "step-0000003" / TOKENIZER_FILE
    assert loaded.fingerprint() == tok.fingerprint()
    assert cfg.data.tokenizer == str(latest.resolve())


def test_a_vocab_size_against_the_tokenizer_is_one_line_and_no_run(tmp_path, capsys):
    tok, tok_path, data = bpe_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--run-dir",
            str(run_dir),
            *SMALL,
            "--set",
            f"data.source='{data}'",
            "--set",
            f"data.tokenizer='{tok_path}'",
            "--set",
            "model.vocab_size=256",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "model.vocab_size = 256" in err and f"has {tok.vocab_size} ids" in err
    assert f"set model.vocab_size = {tok.vocab_size}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["error.log"]


def test_a_resume_with_another_tokenizer_is_refused(bpe_run, tmp_path, capsys):
    from bdh_train.data.tokenizer import train_bpe

    run_dir, tok, _, _, _ = bpe_run
    other = train_bpe([BPE_TEXT[::-1]], tok.vocab_size)
    assert other.vocab_size == tok.vocab_size and other.fingerprint() != tok.fingerprint()
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code = main(
        [
            "train",
            "--resume",
            str(run),
            "--set",
            "training.max_steps=6",
            "--set",
            f"data.tokenizer='{other.save(tmp_path)}'",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "is not the tokenizer the checkpoint" in err
    assert load_fingerprint(run / TOKENIZER_FILE) == tok.fingerprint()  # the run's copy kept
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_moved_run_resumes_with_its_own_tokenizer_copy(bpe_run, tmp_path, capsys):
    """config.toml names the run's tokenizer copy by absolute path; after the directory moves,
    a resume reads the copy in the new place and names it from then on."""
    run_dir, tok, _, _, _ = bpe_run
    first, moved = tmp_path / "first", tmp_path / "moved"
    shutil.copytree(run_dir, first)
    resume = ["--set", "model.quant.warmup_steps=0", "--set", "training.checkpoint_every=1"]
    assert main(["train", "--resume", str(first), *resume, "--set", "training.max_steps=4"]) == 0
    assert str((first / TOKENIZER_FILE).resolve()) in (first / "config.toml").read_text()
    first.rename(moved)
    assert main(["train", "--resume", str(moved), *resume, "--set", "training.max_steps=5"]) == 0
    assert str((moved / TOKENIZER_FILE).resolve()) in (moved / "config.toml").read_text()
    assert (moved / "checkpoints" / "step-0000005").is_dir()
    assert load_fingerprint(moved / TOKENIZER_FILE) == tok.fingerprint()
    capsys.readouterr()


def load_fingerprint(path) -> str:
    return load_tokenizer(path).fingerprint()
