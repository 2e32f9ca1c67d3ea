"""What the state remembers (`bdh_train.evals`): each measure on a case whose answer is known.

- context curve: bucket edges by hand; carried and block losses against one model call per
  stretch and per block, bucketed by a hand loop over positions (float64, 1e-10); the two
  readings agree up to the block and differ after it;
- retention: a model without memory (its value projection zeroed: no token reaches another)
  gives the same window, carried and reset numbers; a real one matches one call per reading;
- passkey: prompts of exactly L tokens with the needle where the depth says; an oracle that
  reads the needle answers every cell, one that sees only the prompt's end only depth 1;
- the command: the files it writes (without --out, into evals/<the model's name>), and its
  refusals (no text tokenizer, a length that does not fit in memory, a length not a multiple
  of the block, pairs that do not fit a recall example) as one line with nothing written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, tiny_model

from bdh_train.cli import main
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.errors import ConfigError
from bdh_train.evals import context as memory
from bdh_train.evals import passkey, scoring
from bdh_train.evals.measures import MemoryEvals
from bdh_train.shared import loading
from bdh_train.storage.places import results_dir


@pytest.fixture(scope="module")
def model64():
    return tiny_model(torch.float64, seed=5)  # vocab 32


def _losses(model, ids: list[int]) -> torch.Tensor:
    """Per-target loss of ids[1:] read in one call from a fresh state."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    return F.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="none")


def test_log_buckets_by_hand():
    assert memory.log_buckets(1) == [1, 2]
    assert memory.log_buckets(12) == [1, 2, 4, 8, 13]
    assert memory.log_buckets(16) == [1, 2, 4, 8, 17]  # not a bucket of t = 16 alone
    assert memory.log_buckets(17) == [1, 2, 4, 8, 16, 18]


def test_context_curve_against_one_call_per_stretch_and_per_block(model64, monkeypatch):
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 32 * 2 * 5)  # 5 tokens a call: chunks carry
    tokens = np.random.default_rng(0).integers(0, 32, size=200)
    block, length, rows = 4, 24, 3
    curve = memory.context_curve(model64, tokens, block, length, rows, batch_size=2)
    carried = torch.zeros(length)
    blocks = torch.zeros(length)
    for r in range(rows):
        row = tokens[r * length : (r + 1) * length + 1].tolist()
        carried += _losses(model64, row) / rows
        for s in range(0, length, block):
            blocks[s : s + block] += _losses(model64, row[s : s + block + 1]) / rows
    buckets: dict[int, list[int]] = {}
    for t in range(1, length + 1):  # target t is predicted after t tokens
        buckets.setdefault(int(math.log2(t)), []).append(t - 1)
    assert curve.edges == [1, 2, 4, 8, 16, 25]
    assert curve.tokens == [rows * len(v) for v in buckets.values()]
    assert_close(
        torch.tensor(curve.carried),
        torch.stack([carried[v].mean() for v in buckets.values()]),
        rtol=1e-10,
        msg="carried",
    )
    assert_close(
        torch.tensor(curve.blocks),
        torch.stack([blocks[v].mean() for v in buckets.values()]),
        rtol=1e-10,
        msg="blocks",
    )
    assert curve.carried[:2] == pytest.approx(curve.blocks[:2], rel=1e-12)  # t < block
    assert abs(curve.carried[-1] - curve.blocks[-1]) > 1e-4
    with pytest.raises(ConfigError, match="multiple of the training block"):
        memory.context_curve(model64, tokens, block, 10, rows, batch_size=2)


def test_last_bucket_line_reads_the_farthest_bucket():
    edges = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4097]
    near = [2.0] * (len(edges) - 2)
    helps = memory.ContextCurve(128, 4096, 4, edges, [4] * 12, [*near, 1.90], [*near, 1.95])
    assert helps.last_bucket_line() == (
        "state gain     +0.0500 nats/token at positions 2,048-4,096 of held-out text (the "
        "state helps): state carried 1.9000, fresh blocks of 128 1.9500"
    )
    hurts = memory.ContextCurve(16, 48, 1, [1, 2, 4, 8, 16, 32, 49], [1] * 6, [3.0] * 6, [2.5] * 6)
    assert hurts.last_bucket_line() == (
        "state gain     -0.5000 nats/token at positions 32-48 of held-out text (the state does "
        "not help): state carried 3.0000, fresh blocks of 16 2.5000"
    )


def test_retention_of_a_model_without_memory_is_the_same_three_ways():
    model = tiny_model(torch.float64, seed=6)
    with torch.no_grad():
        model.encoder_v.zero_()  # y = x * relu(a @ 0) = 0: no token's output sees another
    tokens = np.random.default_rng(1).integers(0, 32, size=100)
    kept = memory.retention(model, tokens, chunk=8, chunks=5, batch_size=3)
    assert len(kept.window) == len(kept.carried) == len(kept.reset) == 4
    assert_close(torch.tensor(kept.carried), torch.tensor(kept.reset), rtol=1e-12)
    assert_close(torch.tensor(kept.window), torch.tensor(kept.reset), rtol=1e-12)


def test_retention_against_one_call_per_reading(model64):
    tokens = np.random.default_rng(2).integers(0, 32, size=100)
    chunk, chunks = 6, 4
    kept = memory.retention(model64, tokens, chunk, chunks, batch_size=2)
    stream = tokens[: chunk * chunks + 1].tolist()
    whole = _losses(model64, stream)
    for k in range(1, chunks):
        lo, hi = k * chunk, (k + 1) * chunk
        assert kept.carried[k - 1] == pytest.approx(float(whole[lo:hi].mean()), rel=1e-10)
        window = _losses(model64, stream[lo - chunk : hi + 1])[chunk:]
        assert kept.window[k - 1] == pytest.approx(float(window.mean()), rel=1e-10)
        reset = _losses(model64, stream[lo : hi + 1])
        assert kept.reset[k - 1] == pytest.approx(float(reset.mean()), rel=1e-10)
    assert kept.window[0] == pytest.approx(kept.carried[0], rel=1e-12)  # nothing older yet
    assert abs(kept.reset[0] - kept.window[0]) > 1e-4


def test_passkey_prompts_plant_the_needle_at_its_depth():
    tok = ByteTokenizer()
    needle = passkey.NEEDLE.format(key="12345").encode()
    question = passkey.QUESTION.encode()
    for length in (120, 333):
        first, answer = passkey.passkey_prompt(tok, length, 0.0, "12345")
        last, _ = passkey.passkey_prompt(tok, length, 1.0, "12345")
        middle, _ = passkey.passkey_prompt(tok, length, 0.5, "12345")
        assert len(first) == len(last) == len(middle) == length
        assert bytes(answer) == b" 12345"
        assert bytes(first).startswith(needle)
        assert bytes(last).endswith(needle + question)
        at = bytes(middle).index(needle)
        fill = length - len(needle) - len(question)
        longest = max(len(s) for s in passkey.FILLER)
        assert abs(at - fill / 2) <= longest / 2 + 1  # the sentence boundary nearest half
        assert bytes(middle)[:at].decode() in "".join(passkey.FILLER) * 9  # whole sentences
    with pytest.raises(ConfigError, match="too short"):
        passkey.passkey_prompt(tok, 60, 0.5, "12345")


def _oracle(sees_last: int | None):
    """A scorer that answers with the key of the needle it can see (the whole prompt, or its
    last `sees_last` tokens): right where it sees one, else wrong."""

    def scorer(pairs):
        out = []
        for prompt, answer in pairs:
            seen = bytes(prompt if sees_last is None else prompt[-sees_last:]).decode()
            found = re.search(r"The pass key is (\d{5})\.", seen)
            right = found is not None and f" {found.group(1)}".encode() == bytes(answer)
            out.append((0.0 if right else -50.0, right))
        return out

    return scorer


def test_passkey_grid_of_oracles():
    tok = ByteTokenizer()
    lengths, depths = [150, 400], [0.0, 0.5, 1.0]
    reads_all = passkey.passkey_grid(_oracle(None), tok, lengths, depths, trials=3)
    assert reads_all.accuracy == [[1.0, 1.0]] * 3
    assert reads_all.answer_log_prob == [[0.0, 0.0]] * 3
    near = passkey.passkey_grid(_oracle(140), tok, lengths, depths, trials=3)
    # "The pass key is" starts at the filler sentence boundary nearest depth x fill (fill =
    # L - 59 - 37 bytes of needle and question): 0, 20, 54 for L = 150 and 0, 146, 304 for
    # 400; the oracle sees it when it starts within the last 140 bytes
    assert near.accuracy == [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]
    assert near.answer_log_prob[0] == [-50 / 6, -50 / 6]  # -50 over the answer's 6 bytes


SMALL = ["--length", "32", "--sequences", "2", "--chunks", "3"]
GRID = ["--passkey-lengths", "100,140", "--passkey-depths", "0,1", "--passkey-trials", "2"]


def test_the_command_writes_each_measure(byte_run, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["eval", "--checkpoint", str(byte_run), "--device", "cpu", "--out", str(out)]
    assert main([*argv, "--context-curve", "--retention", "--passkey", *SMALL, *GRID]) == 0
    printed = capsys.readouterr().out
    assert "context curve: 2 x 32 tokens, blocks of 16" in printed
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "context_curve.json",
        "context_curve.png",
        "passkey.json",
        "passkey.png",
        "retention.json",
    ]
    curve = json.loads((out / "context_curve.json").read_text())
    assert curve["edges"] == [1, 2, 4, 8, 16, 33]
    assert len(json.loads((out / "retention.json").read_text())["reset"]) == 2
    grid = json.loads((out / "passkey.json").read_text())
    assert grid["lengths"] == [100, 140] and grid["depths"] == [0.0, 1.0]
    assert all(0.0 <= a <= 1.0 for row in grid["accuracy"] for a in row)
    assert (out / "passkey.png").read_bytes().startswith(b"\x89PNG")


def test_without_out_each_model_writes_into_its_own_folder(byte_run, tmp_path, capsys, monkeypatch):
    """No --out: evals/<run> for a run, evals/<run>-<checkpoint> for one of its checkpoints,
    evals/<stem> for a file, under the working directory; so a second model evaluated there
    is not refused for the first one's files."""
    monkeypatch.chdir(tmp_path)
    step = sorted((byte_run / "checkpoints").glob("step-*"))[-1]
    argv = ["eval", "--device", "cpu", "--context-curve", *SMALL]
    assert main([*argv, "--checkpoint", str(byte_run)]) == 0
    assert main([*argv, "--checkpoint", str(step)]) == 0
    printed = capsys.readouterr().out
    folders = [Path("evals", byte_run.name), Path("evals", f"{byte_run.name}-{step.name}")]
    for folder in folders:
        assert f"wrote {folder / 'context_curve.json'}" in printed, printed
        assert sorted(p.name for p in folder.iterdir()) == [
            "context_curve.json",
            "context_curve.png",
        ]
    assert sorted(Path("evals").iterdir()) == sorted(folders)
    export = tmp_path / "tiny.ternary"
    export.write_bytes(b"")
    assert results_dir(export) == Path("evals", "tiny")


def test_the_smoke_test_cap_bounds_each_measure(byte_run, tmp_path, capsys, monkeypatch):
    """BDH_TRAIN_MAX_STEPS=1: one context-curve sequence, one passkey trial a cell."""
    assert MemoryEvals(sequences=4, passkey_trials=4, recall_examples=32).capped(None) == (
        MemoryEvals(sequences=4, passkey_trials=4, recall_examples=32)
    )
    sized = MemoryEvals(sequences=4, passkey_trials=1, recall_examples=32).capped(2)
    assert (sized.sequences, sized.passkey_trials, sized.recall_examples) == (2, 1, 2)
    monkeypatch.setenv("BDH_TRAIN_MAX_STEPS", "1")
    argv = ["eval", "--checkpoint", str(byte_run), "--device", "cpu", "--out", str(tmp_path)]
    assert main([*argv, "--context-curve", "--passkey", *SMALL, *GRID]) == 0
    printed = capsys.readouterr().out
    assert "context curve: 1 x 32 tokens" in printed, printed
    assert "passkey: accuracy over 1 keys per cell" in printed, printed


def _refused(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_refusals_are_one_line_and_write_nothing(
    byte_run, tmp_path, capsys, monkeypatch, bounded_memory
):
    out = tmp_path / "out"
    argv = ["eval", "--checkpoint", str(byte_run), "--device", "cpu", "--out", str(out)]
    _refused(capsys, [*argv, "--context-curve", "--length", "20"], "multiple of the training")
    _refused(capsys, [*argv, "--passkey", "--passkey-depths", "0,2"], "must lie in [0, 1]")
    # 10^14 tokens: refused before a prompt is built (building it would exhaust memory)
    _refused(capsys, [*argv, "--passkey", "--passkey-lengths", "100000000000000"], "GiB for")
    monkeypatch.setattr("bdh_train.shared.loading.tokenizer_for", lambda config: None)
    no_text = (
        "error: --context-curve and --retention read text, --passkey writes it: it needs a "
        "token-head model with a tokenizer (a byte-level model, vocab_size 256, or a run that "
        "carries its tokenizer.json)"
    )
    _refused(capsys, [*argv, "--passkey"], no_text + "\n")
    # a run on MQAR data (no tokenizer) is pointed at the measure made for it
    real = loading.load_run

    def as_mqar(*args, **kwargs):
        model, tok, cfg = real(*args, **kwargs)
        return model, tok, replace(cfg, data=replace(cfg.data, source="mqar"))

    monkeypatch.setattr(loading, "load_run", as_mqar)
    measured = no_text + "; an MQAR run's memory is measured with eval --recall\n"
    _refused(capsys, [*argv, "--context-curve"], measured)
    assert not out.exists()


RECALL = ["--recall-pairs", "1,2", "--recall-lengths", "16,32", "--recall-examples", "2"]


def test_recall_writes_its_grid_and_refuses_bad_cells(byte_run, tmp_path, capsys, bounded_memory):
    out = tmp_path / "out"
    argv = ["eval", "--checkpoint", str(byte_run), "--device", "cpu", "--out", str(out)]
    _refused(
        capsys,
        [*argv, "--recall", "--recall-pairs", "5", "--recall-lengths", "16,32"],
        "5 pairs need at least 20 tokens per example",
    )
    _refused(capsys, [*argv, "--recall", "--recall-lengths", "0,16"], "must be positive")
    _refused(capsys, [*argv, "--recall", "--recall-examples", "0"], "must be a positive")
    _refused(capsys, [*argv, "--recall", "--recall-lengths", "100000000000000"], "GiB for")
    assert not out.exists()
    assert main([*argv, "--recall", *RECALL]) == 0
    assert "recall (MQAR): accuracy over 2 examples per cell" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["recall.json", "recall.png"]
    grid = json.loads((out / "recall.json").read_text())
    assert grid["pairs"] == [1, 2] and grid["lengths"] == [16, 32] and grid["vocab_size"] == 256
    assert all(0.0 <= a <= 1.0 for row in grid["accuracy"] for a in row)


@pytest.mark.parametrize(
    ("option", "value", "kind"),
    [("--passkey-lengths", "1,,2", "integers"), ("--passkey-depths", "0,half", "numbers")],
)
def test_a_bad_list_names_its_option_and_the_form_it_wants(option, value, kind, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["eval", "--checkpoint", "nowhere", "--passkey", option, value])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"error: bdh-train eval: argument {option}: a comma-separated list of {kind}, "
        f"e.g. {'512,1024' if kind == 'integers' else '0,0.5,1'}, got {value!r}; see "
        "'bdh-train eval --help'\n"
    )
