"""`bdh-train export --hf DIR`: the exported directory loads in transformers with bdh_train
not importable, and computes what bdh-train computes: logits of a left-padded batch read in
blocks, greedy generation (and sampling with top_k=1) for 200 tokens, beam search scored by
the model's own log-probabilities, the loss of `labels` as `bdh-train eval` gives it; the
tokenizer files encode as the run's tokenizer (bytes and a BPE). Refusals are one line and
write nothing.

All the transformers side runs in ONE subprocess (`HF_SIDE`, importing transformers costs
seconds) over seven exports: a trained byte run (rope), the same run grown to twice its neurons (its
rope table is no longer the one computed from N), and five ternary exports built here,
one alibi_learned with an affine norm and a BPE, one alibi and one alibi_spread quantizing the
decoder only, and two under the token shift (`model.token_shift`), one rope quantizing the
decoder only and one alibi_slow quantizing the encoder only (its int8 rounding reads the shifted
input; the paper's names, which `quant.target_modules` takes, swap encoder and decoder)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MICRO, assert_close, bpe_corpus, tiny_config

from bdh_train.cli import main
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.export.ternary import export_ternary
from bdh_train.model import BDH, sampling
from bdh_train.model.config import QuantConfig, SummaryMemoryConfig
from bdh_train.model.positions import rope_frequencies
from bdh_train.shared.loading import load_run
from bdh_train.storage.ternary import load_ternary
from bdh_train.train.metrics import read_metrics

HF_SIDE = r"""
import importlib.abc, json, sys

class _NoBDHTrain(importlib.abc.MetaPathFinder):
    # bdh-train is not installed here: an editable install's finder never gets to answer
    def find_spec(self, name, path=None, target=None):
        if name == "bdh_train" or name.startswith("bdh_train."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _NoBDHTrain())
try:
    import bdh_train  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("bdh_train is importable in the transformers process")

import builtins, logging, os, warnings
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

asked, warned = [], []
def _no_answer(prompt=""):  # a question to the terminal (trust_remote_code) is recorded
    asked.append(prompt)
    raise EOFError
builtins.input = _no_answer
class _Warned(logging.Handler):
    def emit(self, record):
        warned.append(record.getMessage())
logging.getLogger("transformers").addHandler(_Warned(logging.WARNING))
warnings.showwarning = lambda message, *args, **kw: warned.append(str(message))

torch.set_num_threads(1)  # tiny models: a second thread only waits on the first
jobs, results = json.load(open(sys.argv[1])), {}
for name, job in jobs.items():
    # the two loading lines of the directory's model card, as a reader runs them (cwd: the
    # directory's parent, the name the card uses)
    card = open(os.path.join(job["dir"], "README.md"), encoding="utf-8").read().splitlines()
    scope = {"AutoModelForCausalLM": AutoModelForCausalLM, "AutoTokenizer": AutoTokenizer}
    asked.clear(), warned.clear()
    for start in ("tokenizer = AutoTokenizer.", "model = AutoModelForCausalLM."):
        exec(next(line for line in card if line.startswith(start)), scope)
    tok, model = scope["tokenizer"], scope["model"].eval()
    out = results[name] = {"type": type(model).__name__, "asked": asked[:], "warned": warned[:]}
    out["encoded"] = [tok.encode(t, add_special_tokens=False) for t in job["texts"]]
    batch = tok(job["texts"], padding=True, return_tensors="pt")
    out["padded"] = batch["input_ids"].tolist()
    out["mask"] = batch["attention_mask"].tolist()
    model.config.prefill_chunk = 8  # the rows are read in blocks that carry the state
    with torch.no_grad():
        read = model(**batch)
    out["logits"] = read.logits.tolist()
    cache = read["cache"] if "cache" in read else read.past_key_values  # the state after it
    out["position"] = cache.position.tolist()
    out["rho"] = [rho.tolist() for rho in cache.rho]
    out["previous"] = [None if p is None else p.tolist() for p in cache.previous]
    if job.get("stepwise"):
        model.config.prefill_chunk = 256  # the batch read in one block
        with torch.no_grad():
            out["whole"] = model(**batch).logits.tolist()
        model.config.prefill_chunk = 8
        cache, steps = None, []  # the longest text read one token per call on the cache
        for token in out["encoded"][-1]:
            with torch.no_grad():
                read = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = read["cache"] if "cache" in read else read.past_key_values
            steps.append(read.logits[0, -1].tolist())
        out["steps"] = steps
        rows = model.generate(**batch, max_new_tokens=20, do_sample=False)  # prompts in blocks
        out["batch_greedy"] = rows[:, batch["input_ids"].shape[1]:].tolist()
        beams = model.generate(  # the cache's rows repeated per beam and reordered
            torch.tensor([out["encoded"][0]]), max_new_tokens=8, num_beams=3, do_sample=False,
            length_penalty=0.0, return_dict_in_generate=True, output_scores=True,
        )
        out["beam"] = beams.sequences[0].tolist()
        out["beam_score"] = float(beams.sequences_scores[0])
    model.config.prefill_chunk = 256
    if "prompt" not in job:
        continue
    prompt = torch.tensor([job["prompt"]])
    widths, read_block = [], model.model.forward_block
    def counting(ids, mask, cache):
        widths.append(ids.shape[1])
        out["cache"] = [c.__name__ for c in type(cache).__mro__]
        return read_block(ids, mask, cache)
    model.model.forward_block = counting
    greedy = model.generate(prompt, max_new_tokens=200, do_sample=False)
    out["greedy"], out["widths"] = greedy[0, prompt.shape[1]:].tolist(), widths
    model.model.forward_block = read_block
    batch = tok(job["texts"], padding=True, return_tensors="pt")
    rows = model.generate(**batch, max_new_tokens=20, do_sample=False)
    out["batch_greedy"] = rows[:, batch["input_ids"].shape[1]:].tolist()
    torch.manual_seed(0)
    top1 = model.generate(prompt, max_new_tokens=20, do_sample=True, top_k=1)
    out["top1"] = top1[0, prompt.shape[1]:].tolist()
    beams = model.generate(
        prompt, max_new_tokens=8, num_beams=3, do_sample=False, length_penalty=0.0,
        return_dict_in_generate=True, output_scores=True,
    )
    out["beam"] = beams.sequences[0].tolist()
    out["beam_score"] = float(beams.sequences_scores[0])
    windows = torch.tensor(job["windows"])
    with torch.no_grad():
        out["loss"] = float(model(windows, labels=windows).loss)
    if "readme" in job:  # the README's example, as written, on this export
        scope = {}
        with torch.no_grad():
            exec(job["readme"], scope)
        out["readme_loss"] = float(scope["loss"])
        out["readme_batch"] = scope["batch"]["input_ids"].tolist()
        out["readme_mask"] = scope["batch"]["attention_mask"].tolist()
json.dump(results, open(sys.argv[2], "w"))
"""

TEXTS = ["The quick brown fox", "Hi", "ROMEO 7: the quick brown fox — ünïcödé 日本 jumps"]
PROMPT = "The "
README_TEXTS = ["ROMEO:", "To be"]
"""The texts of the README's transformers example."""
BLOCK = 16  # training.block_size of MICRO
WINDOWS = 3
SHIFTED = [("shift", 4, "rope", "encoder"), ("shift_alibi", 5, "alibi_slow", "decoder_x")]
"""The token-shift exports: name, seed, position, the one quantized projection (the paper's
name: 'encoder' is BDH's decoder, 'decoder_x' BDH's encoder)."""
SHIFTS = [name for name, *_ in SHIFTED]


def _refusal(capsys, args: list[str]) -> str:
    """The one error line of a refused command (exit 2)."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _ternary(path, seed: int, tokenizer_json: str | None = None, **overrides) -> BDH:
    """A BitNet model exported as a ternary file (its gains and affine norm, where it has
    them, moved off their initial values so that they matter), and that file loaded back."""
    torch.manual_seed(seed)
    model = BDH(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("norm.") or name == "decay_log_gain":
                p.add_(0.3 * torch.randn_like(p))
    export_ternary(model, path, tokenizer_json)
    return load_ternary(path)


def readme_hf_example() -> str:
    """The README's Python block that loads an export with transformers."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if "AutoModelForCausalLM" in b]
    return block


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The bdh-train side (models, tokenizers, the run) and the transformers side's results."""
    root = tmp_path_factory.mktemp("hf")
    run = root / "run"
    rope = ["--set", "model.position='rope'"]  # the preset's alibi is the 'alibi' side's
    assert main(["train", "--run-dir", str(run), *MICRO, *rope]) == 0
    assert main(["export", "--hf", str(root / "run_hf"), str(run)]) == 0
    # a grown model's rope table repeats its source's: not the table computed from its own N
    grow = ["grow", "--checkpoint", str(run), "--neurons-multiplier", "2"]
    assert main([*grow, "--out", str(root / "grown")]) == 0
    assert main(["export", "--hf", str(root / "grown_hf"), str(root / "grown")]) == 0
    grown = load_run(root / "grown")[0]
    assert not torch.equal(grown.rope_freqs, rope_frequencies(grown.config.n_neurons))
    bpe, _, _ = bpe_corpus(root / "corpus")
    quant = QuantConfig(enable=True)
    sides = {
        "run": (load_run(run)[0], ByteTokenizer()),
        "grown": (grown, ByteTokenizer()),
        "bpe": (
            _ternary(
                root / "bpe.safetensors",
                1,
                bpe.to_json(),
                vocab_size=bpe.vocab_size,
                position="alibi_learned",
                norm="layernorm_affine",
                quant=quant,
            ),
            bpe,
        ),
        "alibi": (
            _ternary(
                root / "alibi.safetensors",
                2,
                vocab_size=256,
                position="alibi",
                quant=QuantConfig(enable=True, target_modules=["encoder"]),
            ),
            ByteTokenizer(),
        ),
        "spread": (
            _ternary(
                root / "spread.safetensors",
                3,
                vocab_size=256,
                position="alibi_spread",
                quant=QuantConfig(enable=True, target_modules=["encoder"]),
            ),
            ByteTokenizer(),
        ),
        **{
            name: (
                _ternary(
                    root / f"{name}.safetensors",
                    seed,
                    vocab_size=256,
                    position=position,
                    token_shift=True,
                    quant=QuantConfig(enable=True, target_modules=[target]),
                ),
                ByteTokenizer(),
            )
            for name, seed, position, target in SHIFTED
        },
    }
    for name in ("bpe", "alibi", "spread", *SHIFTS):
        assert (
            main(["export", "--hf", str(root / f"{name}_hf"), str(root / f"{name}.safetensors")])
            == 0
        )
    eval_text = ("ROMEO: the quick brown fox jumps over the lazy dog. " * 2)[: WINDOWS * BLOCK + 1]
    (root / "eval.txt").write_text(eval_text)
    byte_ids = ByteTokenizer().encode(eval_text)
    assert len(byte_ids) == WINDOWS * BLOCK + 1
    jobs = {name: {"dir": str(root / f"{name}_hf"), "texts": TEXTS} for name in sides}
    jobs["run"]["prompt"] = ByteTokenizer().encode(PROMPT)
    for name in SHIFTS:
        jobs[name]["stepwise"] = True
    jobs["run"]["windows"] = [byte_ids[j * BLOCK : j * BLOCK + BLOCK + 1] for j in range(WINDOWS)]
    jobs["run"]["readme"] = readme_hf_example().replace(
        '"bdh-shakespeare"', repr(jobs["run"]["dir"])
    )
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "hf_side.py").write_text(HF_SIDE)
    env = {**os.environ, "HF_HOME": str(root / "hf_home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-I", "hf_side.py", "jobs.json", "results.json"],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    return root, sides, results


@pytest.mark.parametrize("name", ["run", "grown", "bpe", "alibi", "spread", *SHIFTS])
def test_left_padded_logits_equal_bdh_train(exported, name):
    """Each row's real tokens get bdh-train's logits of the row alone (fp32, 1e-5), with the
    pads on the left and the rows read 8 tokens at a time (under the token shift a token's
    previous one is the row's last real token, across blocks, never a pad); the tokenizer files
    encode as the run's tokenizer."""
    _, sides, results = exported
    model, tok = sides[name]
    out = results[name]
    assert out["type"] == "BDHForCausalLM"
    assert out["encoded"] == [tok.encode(t) for t in TEXTS]
    logits = torch.tensor(out["logits"])
    lengths = [len(tok.encode(t)) for t in TEXTS]
    assert min(lengths) < logits.shape[1] == max(lengths) > 8  # padded rows, several blocks
    for row, (text, n) in enumerate(zip(TEXTS, lengths, strict=True)):
        assert out["mask"][row] == [0] * (logits.shape[1] - n) + [1] * n
        assert out["padded"][row][-n:] == tok.encode(text)
        with torch.no_grad():
            expected, _ = model(torch.tensor([tok.encode(text)]))
        assert_close(logits[row, -n:], expected[0], rtol=1e-5, msg=f"{name} row {row}")


@pytest.mark.parametrize("name", ["run", "grown", "bpe", "alibi"])
def test_the_card_s_loading_lines_ask_nothing_and_warn_nothing(exported, name):
    """The tokenizer and model load as the model card writes them with no question on the
    terminal (whether to run the custom code) and no warning."""
    _, _, results = exported
    assert results[name]["asked"] == []
    assert results[name]["warned"] == []


@pytest.mark.parametrize("name", ["run", "alibi", *SHIFTS])
def test_the_cache_after_a_left_padded_batch_is_each_row_s_own_state(exported, name):
    """The state a row leaves is bdh-train's state of the row alone (fp32, 1e-5), read in
    blocks of 8 behind its pads: its position is its real tokens, and rho, which holds keys
    rotated by their absolute positions, has them at the row's own (a position shifted by the
    pads or the blocks leaves the logits alone, rope being relative, but not rho); under the
    token shift each layer's carried input is the row's last real token's (none without)."""
    _, sides, results = exported
    model, tok = sides[name]
    out = results[name]
    assert out["position"] == [len(tok.encode(t)) for t in TEXTS]
    for row, text in enumerate(TEXTS):
        state = model.init_state(1)
        with torch.no_grad():
            model.forward_hidden(torch.tensor([tok.encode(text)]), state)
        for layer, rho in enumerate(out["rho"]):
            assert_close(
                torch.tensor(rho[row]), state.rho[layer][0], rtol=1e-5, msg=f"row {row} {layer}"
            )
        if not model.config.token_shift:
            assert out["previous"] == [None] * model.config.n_layer
            continue
        for layer, previous in enumerate(out["previous"]):
            assert_close(
                torch.tensor(previous[row]),
                state.previous[layer][0],
                rtol=1e-5,
                msg=f"previous row {row} {layer}",
            )


def test_generation_equals_bdh_train(exported):
    """Greedy generate() gives bdh-train's greedy 200 tokens (sampling with top_k=1 their
    first 20), one cache step per token after the prompt, and each row of a left-padded
    batch the tokens bdh-train generates for it alone; beam search's best score is the sum
    of bdh-train's log-probabilities of the tokens it generated (length_penalty=0: the score
    is not divided by a length)."""
    _, sides, results = exported
    model, tok = sides["run"]
    out = results["run"]
    prompt = tok.encode(PROMPT)
    expected = sampling.generate(model, torch.tensor([prompt]), 200, temperature=0.0)[
        0, len(prompt) :
    ]
    assert out["greedy"] == expected.tolist()
    assert out["top1"] == out["greedy"][:20]
    # the state is a transformers Cache, and each new token is one step on it
    assert "Cache" in out["cache"] and out["cache"][0] == "BDHCache"
    assert out["widths"] == [len(prompt)] + [1] * 199
    prompts = [tok.encode(text) for text in TEXTS]  # a left-padded batch: each row's own
    alone = sampling.generate_batch(model, prompts, 20, temperature=0.0)
    assert out["batch_greedy"] == [
        r[len(p) :].tolist() for r, p in zip(alone, prompts, strict=True)
    ]
    _assert_beam_scored_by_bdh_train(model, prompt, out)


def _assert_beam_scored_by_bdh_train(model: BDH, prompt: list[int], out: dict) -> None:
    """The best beam continues `prompt` by 8 tokens, and its score is the sum of bdh-train's
    log-probabilities of them (1e-5)."""
    beam = out["beam"]
    assert beam[: len(prompt)] == prompt and len(beam) == len(prompt) + 8
    with torch.no_grad():
        logits, _ = model(torch.tensor([beam]))
    log_probs = torch.log_softmax(logits[0].double(), dim=-1)
    total = sum(float(log_probs[t - 1, beam[t]]) for t in range(len(prompt), len(beam)))
    assert abs(out["beam_score"] - total) <= 1e-5 * abs(total)


@pytest.mark.parametrize("name", SHIFTS)
def test_token_shift_reads_token_by_token_and_generates_as_bdh_train(exported, name):
    """Under the token shift: the left-padded batch read in one block gives the logits read in
    blocks of 8; the longest text read one token per call on the cache (the carried input is
    the next token's previous) gives bdh-train's logits of the whole text (fp32, 1e-5); greedy
    generate() on the left-padded batch, its prompts read in blocks of 8, gives each row the
    20 tokens bdh-train generates for it alone; beam search (the carried inputs repeated per
    beam and reordered with rho) scores its best beam by bdh-train's log-probabilities;
    config.json and the card say token_shift."""
    root, sides, results = exported
    model, tok = sides[name]
    out = results[name]
    assert_close(torch.tensor(out["whole"]), torch.tensor(out["logits"]), rtol=1e-5)
    ids = tok.encode(TEXTS[-1])
    assert len(out["steps"]) == len(ids) > 8
    with torch.no_grad():
        expected, _ = model(torch.tensor([ids]))
    assert_close(torch.tensor(out["steps"]), expected[0], rtol=1e-5, msg=f"{name} steps")
    alone = [
        sampling.generate(model, torch.tensor([tok.encode(t)]), 20, temperature=0.0)[0]
        for t in TEXTS
    ]
    assert out["batch_greedy"] == [
        r[len(tok.encode(t)) :].tolist() for r, t in zip(alone, TEXTS, strict=True)
    ]
    _assert_beam_scored_by_bdh_train(model, tok.encode(TEXTS[0]), out)
    assert json.loads((root / f"{name}_hf" / "config.json").read_text())["token_shift"] is True
    assert "token shift: yes" in (root / f"{name}_hf" / "README.md").read_text()


def test_loss_of_labels_equals_bdh_train_eval(exported, capsys):
    root, _, results = exported
    capsys.readouterr()
    args = ["eval", "--checkpoint", str(root / "run"), "--data", str(root / "eval.txt")]
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tokens"] == WINDOWS * BLOCK
    assert abs(results["run"]["loss"] - row["val_loss"]) <= 1e-5 * row["val_loss"]


def test_the_readme_example_loss_counts_each_rows_own_text(exported):
    """The README's padded-batch loss is the mean next-token cross-entropy of each row read
    alone (fp32, 1e-5): pads and the token after them are not counted."""
    _, sides, results = exported
    model, tok = sides["run"]
    out = results["run"]
    rows = [
        [t for t, real in zip(ids, mask, strict=True) if real]
        for ids, mask in zip(out["readme_batch"], out["readme_mask"], strict=True)
    ]
    assert rows == [tok.encode(t) for t in README_TEXTS] and len({len(r) for r in rows}) > 1
    total, count = 0.0, 0
    for ids in rows:
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]))
        targets = torch.tensor(ids[1:])
        total += float(torch.nn.functional.cross_entropy(logits[0, :-1], targets, reduction="sum"))
        count += len(ids) - 1
    assert abs(out["readme_loss"] - total / count) <= 1e-5 * (total / count)


def test_directory_and_model_card(exported):
    """The files a Hub repository needs, and a card with the run's steps and last losses."""
    root, _, _ = exported
    out = root / "run_hf"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "README.md",
            "config.json",
            "configuration_bdh.py",
            "generation_config.json",
            "model.safetensors",
            "modeling_bdh.py",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bdh"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_bdh.BDHForCausalLM"
    assert config["token_shift"] is False
    rows = read_metrics(root / "run" / "metrics.jsonl")
    train = [r["loss"] for r in rows if "loss" in r][-1]
    val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    card = (out / "README.md").read_text()
    assert "- steps: 3; tokens: 192; block size 16, batch size 4" in card
    assert "token shift: no" in card
    assert f"- final train loss: {train:.4f} nats per token" in card
    assert f"- final validation loss: {val:.4f} nats per token" in card
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no staging left


def test_bad_input_is_one_line_and_writes_nothing(exported, tmp_path, capsys):
    root, _, _ = exported
    run = str(root / "run")
    existing = tmp_path / "exists"
    existing.mkdir()
    assert "exists: choose a new path for the output" in _refusal(
        capsys, ["export", "--hf", str(existing), run]
    )
    assert not any(existing.iterdir())
    out = tmp_path / "out"
    assert "does not exist" in _refusal(capsys, ["export", "--hf", str(out), str(tmp_path / "no")])
    assert "takes one RUN" in _refusal(capsys, ["export", "--hf", str(out), run, "x"])
    assert "needs RUN and OUT" in _refusal(capsys, ["export", "--ternary", run])
    assert "needs RUN and OUT" in _refusal(capsys, ["export", "--ternary", "--checkpoint", run])
    assert "give it as RUN or --checkpoint RUN" in _refusal(capsys, ["export", "--hf", str(out)])
    twice = ["export", "--ternary", "--checkpoint", run, run, str(tmp_path / "t.safetensors")]
    assert f"got RUN twice: --checkpoint {run} and {run}" in _refusal(capsys, twice)
    assert "takes one RUN" in _refusal(
        capsys, ["export", "--hf", str(out), "--checkpoint", run, "x"]
    )
    inside = root / "run" / "checkpoints" / "hf"
    assert "inside" in _refusal(capsys, ["export", "--hf", str(inside), run])
    assert not inside.exists()
    refused = {
        "no text tokenizer": {"vocab_size": 40},
        "summary memory": {"vocab_size": 256, "summary_memory": SummaryMemoryConfig(enabled=True)},
        "one scale per tensor": {
            "vocab_size": 256,
            "quant": QuantConfig(enable=True, act_format="int8_tensor_mean"),
        },
    }
    for reason, overrides in refused.items():
        source = tmp_path / "model.safetensors"
        overrides.setdefault("quant", QuantConfig(enable=True))
        torch.manual_seed(0)
        export_ternary(BDH(tiny_config(**overrides)), source, force=True)
        assert reason in _refusal(capsys, ["export", "--hf", str(out), str(source)])
    broken = BDH(tiny_config(vocab_size=256, quant=QuantConfig(enable=True)))
    with torch.no_grad():
        broken.embed.weight[3, 1] = float("nan")
    export_ternary(broken, source, force=True)
    assert "not finite" in _refusal(capsys, ["export", "--hf", str(out), str(source)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "model.safetensors"]
