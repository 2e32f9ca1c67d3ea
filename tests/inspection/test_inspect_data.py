"""What `inspect` reads is what `eval` reads (`DataConfig.evaluation_data`): --data (a
prepared corpus gives its validation split), else the run's validation split, and a run
without one is refused by both alike rather than inspected on its training data."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import tiny_model

from bdh_train.cli import main
from bdh_train.compose.common import Source, write_composed
from bdh_train.config import RunConfig
from bdh_train.data.prepared import prepare_corpus
from bdh_train.data.tokenizer import ByteTokenizer

TEXT = "".join(
    f"line {i}: the cat sat on the mat, and the dog lay by the door.\n" for i in range(60)
)


@pytest.fixture(scope="module")
def no_validation(tmp_path_factory) -> tuple[Path, Path]:
    """(a checkpoint of a byte model whose run has no validation split, its training text),
    written without training."""
    base = tmp_path_factory.mktemp("no_validation")
    text = base / "train.txt"
    text.write_text(TEXT)
    cfg = RunConfig()
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, source=str(text), val_fraction=0.0),
        training=dataclasses.replace(cfg.training, block_size=16, batch_size=2),
    )
    model = tiny_model(vocab_size=256)
    out = write_composed(base / "checkpoint", model, Source(str(base), model, ByteTokenizer(), cfg))
    return out, text


def _inspect(checkpoint: Path, out: Path, *extra: str) -> int:
    args = ["inspect", "--checkpoint", str(checkpoint), "--device", "cpu", "--out", str(out)]
    return main([*args, "--max-tokens", "64", "--graph-neurons", "16", *extra])


def test_eval_and_inspect_refuse_a_run_without_a_validation_split_alike(no_validation, capsys):
    checkpoint, _ = no_validation
    out = checkpoint.parent / "report"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(checkpoint)]) == 2
    from_eval = capsys.readouterr().err
    assert _inspect(checkpoint, out) == 2
    from_inspect = capsys.readouterr().err
    assert (
        from_eval
        == from_inspect
        == ("error: the run has no validation split (data.val_fraction = 0); pass --data SOURCE\n")
    )
    assert not out.exists()


def test_inspect_reads_a_prepared_corpus_validation_split_as_eval_does(
    no_validation, tmp_path, monkeypatch
):
    monkeypatch.setattr("bdh_train.inspect.analysis.sparsity_figure", lambda *args: "")
    monkeypatch.setattr("bdh_train.inspect.analysis.degree_figure", lambda *args: "")
    checkpoint, text = no_validation
    corpus = tmp_path / "corpus"
    prepare_corpus([text], corpus, val_fraction=0.2, progress=False)
    cfg = RunConfig()
    val = cfg.data.evaluation_data(str(corpus), 256, 16)
    assert val.source == cfg.data.load_source(str(corpus / "val.bin"), 256).source
    assert len(val) < len(cfg.data.load_source(str(corpus), 256))  # not the training split
    assert _inspect(checkpoint, tmp_path / "report", "--data", str(corpus)) == 0
    numbers = json.loads((tmp_path / "report" / "inspect.json").read_text())
    assert numbers["data"] == val.source
