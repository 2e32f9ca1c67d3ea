"""Paths a new user walks that used to stop halfway: a prepared corpus brings its tokenizer
(`data.source=DIR` alone), `eval` takes a BPE ternary export with its prepared corpus and says
how its figure relates to train's, a file that is no checkpoint is one clear line, `gpu` is
taken for `cuda`, and a failed `train` leaves no runs/<time>/ behind."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from helpers import BPE_TEXT, MICRO_RUN, set_args

from bdh_train.cli import main
from bdh_train.data.prepared import prepare_corpus
from bdh_train.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from bdh_train.train.metrics import read_metrics

BITNET = Path(__file__).parents[2] / "configs" / "bitnet.toml"
RUN = set_args(
    [
        *MICRO_RUN,
        "model.n_layer=1",
        "model.quant.warmup_steps=0",
        "training.max_steps=3",
        "training.log_every=1",
        "training.eval_every=3",
        "training.eval_steps=2",
        "training.checkpoint_every=0",
    ]
)


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    """(prepared BPE corpus, run directory, ternary export) of a 3-step BitNet run whose only
    data setting is data.source = the corpus."""

    root = tmp_path_factory.mktemp("friction")
    text = root / "text.txt"
    text.write_text(BPE_TEXT)
    corpus = root / "corpus"
    prepare_corpus([text], corpus, train_bpe_vocab=300, val_fraction=0.1, progress=False)
    run = root / "run"
    argv = ["train", "--run-dir", str(run), "--config", str(BITNET), *RUN]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--set", f"data.source='{corpus}'"]) == 0
        export = root / "model.ternary.safetensors"
        assert main(["export", "--ternary", str(run), str(export)]) == 0
    return corpus, run, export


def test_a_prepared_corpus_brings_its_tokenizer(corpus_run, capsys):
    corpus, run, _ = corpus_run
    own = load_tokenizer(corpus / TOKENIZER_FILE)
    assert load_tokenizer(run / TOKENIZER_FILE).fingerprint() == own.fingerprint()
    assert main(["config", "--set", f"data.source='{corpus}'"]) == 0
    config = capsys.readouterr().out
    assert f'tokenizer = "{corpus / TOKENIZER_FILE}"' in config
    assert f"vocab_size = {own.vocab_size}" in config  # followed the tokenizer


def test_a_named_tokenizer_that_is_not_the_corpus_s_is_one_line(corpus_run, tmp_path, capsys):
    corpus, _, _ = corpus_run
    run = tmp_path / "run"
    source = ["--set", f"data.source='{corpus}'"]
    assert main(["train", "--run-dir", str(run), *source, "--set", "data.tokenizer=bytes"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: prepared corpus '{corpus}' was ")
    assert err.rstrip().endswith(
        f"set data.tokenizer = '{corpus}', or leave data.tokenizer out (a prepared corpus "
        "brings its own)"
    )
    assert sorted(p.name for p in run.iterdir()) == ["error.log"]  # a --run-dir keeps its log
    assert main(["config", *source, "--set", f"data.tokenizer='{corpus}'"]) == 0  # its own


def _eval(*args: str) -> tuple[dict, str]:
    """`bdh-train eval ARGS`'s JSON and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["eval", "--device", "cpu", *args]) == 0
    return json.loads(out.getvalue()), err.getvalue()


@pytest.fixture(scope="module")
def run_eval(corpus_run):
    """`eval --checkpoint RUN` (the whole validation split): its JSON and stderr."""
    return _eval("--checkpoint", str(corpus_run[1]))


def test_eval_of_the_export_on_its_corpus_equals_eval_of_its_run(corpus_run, run_eval):
    """The export carries the tokenizer and the run's block and batch sizes; --data DIR is
    the corpus's validation split, the run's own."""
    corpus, _, export = corpus_run
    of_run, _ = run_eval
    of_export, _ = _eval("--checkpoint", str(export), "--data", str(corpus))
    assert of_export["tokens"] == of_run["tokens"] > 0
    for key in ("val_loss", "bits_per_byte"):
        assert of_export[key] == pytest.approx(of_run[key], rel=1e-5), key


def test_eval_says_how_its_figure_relates_to_train_s(corpus_run, run_eval):
    """train evaluates training.eval_steps batches sampled across the validation split: eval
    --batches 2 gives the figure train recorded last; eval alone takes every batch, and says
    so first, then shows its progress on stderr."""
    _, run, _ = corpus_run
    trained = [row for row in read_metrics(run / "metrics.jsonl") if "val_loss" in row][-1]
    two, err = _eval("--checkpoint", str(run), "--batches", "2")
    assert two["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)
    assert two["bits_per_byte"] == pytest.approx(trained["bits_per_byte"], rel=1e-6)
    assert err.startswith("eval: 2 of ")
    whole, err = run_eval
    total = err.split("eval: all ", 1)[1].split(" batches", 1)[0]
    assert err.startswith(
        f"eval: all {total} batches of 4 x 16 tokens of the run's validation split (of "
    )
    assert (
        "train's val_loss is over training.eval_steps = 2 batches sampled across the run's "
        "validation split (--batches 2 gives the figure train printed last)\n"
    ) in err
    assert f" 0/{total} [" in err  # the progress bar (tqdm's first state)
    assert int(total) > 2 and whole["tokens"] > two["tokens"]


def test_a_file_that_is_no_checkpoint_is_one_clear_line(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello world, these are notes\n")
    for command in ("generate", "eval"):
        extra = ["--data", str(text)] if command == "eval" else []
        assert main([command, "--checkpoint", str(text), "--device", "cpu", *extra]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"error: '{text}' is neither a checkpoint nor a ternary export (not a safetensors "
            "file): give a run directory, a checkpoint directory or a file written by "
            "`bdh-train export --ternary`\n"
        )


def test_gpu_is_taken_for_cuda(capsys):
    assert main(["config", "--set", "training.device=gpu"]) == 2
    assert capsys.readouterr().err == (
        "error: training.device must be one of 'auto', 'cpu', 'cuda', got 'gpu' "
        "(did you mean 'cuda'?)\n"
    )


@pytest.mark.parametrize(
    "override", ["training.lr=1", "data.source='missing.txt'"], ids=["config", "data"]
)
def test_a_failed_train_leaves_no_stamped_run_directory(tmp_path, monkeypatch, capsys, override):
    """Without --run-dir, a train refused before it wrote anything (a bad key; data that is
    not there, found after the run directory's lock was taken) leaves no runs/<time>/ holding
    only its error log, and no runs/ it made for it; the error is on stderr."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", override]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "runs").mkdir()  # a runs/ of earlier runs stays
    assert main(["train", "--set", override]) == 2
    assert list(tmp_path.iterdir()) == [tmp_path / "runs"]
    assert list((tmp_path / "runs").iterdir()) == []
