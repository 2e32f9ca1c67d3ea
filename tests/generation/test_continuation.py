"""Continuing a sequence across calls: `Continuation` (feed, sample, save, load) against the
one-call `sampling.generate`, and the chat loop built on it. float64 models, so greedy choices
are not decided by rounding."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json

import numpy as np
import pytest
import torch
from helpers import assert_close, tiny_model

from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.errors import CheckpointError, DataError
from bdh_train.generation.chat import chat
from bdh_train.generation.continuation import Continuation
from bdh_train.model import sampling
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.shared.loading import LATER_FIELDS, config_hash

GATED = SummaryMemoryConfig(enabled=True, chunk_tokens=4, write_gate=True, residual_scale=1.0)
TRIGGER = SummaryEventTrigger(sequence=(2, 3, 0))


def models():
    """(model, events): a plain model, and one whose summary memory is written at events."""
    return [
        (tiny_model(torch.float64, vocab_size=4).eval(), None),
        (tiny_model(torch.float64, vocab_size=4, summary_memory=GATED).eval(), TRIGGER),
    ]


def assert_state_is_the_whole_sequence(cont: Continuation, model, events, seq: list[int]):
    """The continuation's last output equals one forward pass over everything it read (a
    random tiny model's samples barely depend on the context; its hidden states do)."""
    idx = torch.tensor([seq])
    mask = None if events is None else events.mask(idx)
    with torch.no_grad():
        whole = model.forward_hidden(idx, summary_event_mask=mask)[:, -1:]
    assert_close(cont.hidden, whole, rtol=1e-10)


def one_call(model, events, prompt: list[int], n: int, temperature: float, seed: int):
    out = sampling.generate(
        model,
        torch.tensor(prompt),
        n,
        temperature,
        generator=torch.Generator().manual_seed(seed),
        summary_events=events,
    )
    return out[len(prompt) :].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("which", [0, 1], ids=["plain", "gated_summary_memory"])
def test_feeding_in_pieces_equals_one_call(which, temperature):
    model, events = models()[which]
    a, b = [3, 0, 1, 2, 3, 2, 3], [0, 2, 3, 0, 1]
    cont = Continuation(model, events)
    cont.feed(a)
    cont.feed(b)
    got = list(cont.sample(16, temperature, None, torch.Generator().manual_seed(5)))
    assert got == one_call(model, events, a + b, 16, temperature, 5)
    assert cont.tokens_read == len(a) + len(b) + 16
    assert_state_is_the_whole_sequence(cont, model, events, a + b + got)


@pytest.mark.parametrize("which", [0, 1], ids=["plain", "gated_summary_memory"])
def test_saved_state_continues_like_the_whole_prompt(tmp_path, which):
    model, events = models()[which]
    first, second = [3, 0, 1, 2, 3, 2, 3, 1, 2, 3], [0, 2, 3]
    saver = Continuation(model, events)
    saver.feed(first)
    saver.save(tmp_path / "state.safetensors")
    loaded = Continuation(model, events).load(tmp_path / "state.safetensors")
    loaded.feed(second)
    got = list(loaded.sample(25, 1.0, None, torch.Generator().manual_seed(2)))
    assert got == one_call(model, events, first + second, 25, 1.0, 2)
    assert_state_is_the_whole_sequence(loaded, model, events, first + second + got)


def test_a_state_file_does_not_grow_with_the_prompt(tmp_path):
    model, events = models()[1]
    sizes = []
    for length in (5, 200):
        cont = Continuation(model, events)
        cont.feed([i % 4 for i in range(length)])
        sizes.append(cont.save(tmp_path / f"{length}.safetensors").stat().st_size)
    assert sizes[0] == sizes[1]


def test_a_state_from_another_model_is_refused(tmp_path):
    cont = Continuation(tiny_model(torch.float64, vocab_size=4))
    cont.feed([1, 2, 3])
    cont.save(tmp_path / "state.safetensors")
    other = tiny_model(torch.float64, vocab_size=4, n_embd=32)
    with pytest.raises(CheckpointError, match="another config"):
        Continuation(other).load(tmp_path / "state.safetensors")
    with pytest.raises(CheckpointError, match="cannot read state file"):
        Continuation(other).load(tmp_path / "missing.safetensors")


def test_chat_keeps_the_state_and_a_turn_costs_only_its_tokens(monkeypatch):
    model = tiny_model(torch.float64, vocab_size=256).eval()
    tok, lines, n = ByteTokenizer(), ["def f(x):\n", "return\n"], 8
    fed: list[int] = []
    forward_hidden = model.forward_hidden

    def counting(idx, *args, **kwargs):
        fed.append(idx.shape[1])
        return forward_hidden(idx, *args, **kwargs)

    monkeypatch.setattr(model, "forward_hidden", counting)
    out = io.StringIO()
    cont = Continuation(model)
    chat(cont, tok, lines[:1], out, n, 0.0, None, torch.Generator())
    before, read_before = len(fed), cont.tokens_read
    chat(cont, tok, lines[1:], out, n, 0.0, None, torch.Generator())
    # the line goes through forward_hidden, the sampled tokens through the fast decoder's
    # steps; not the history again
    assert sum(fed[before:]) == len(tok.encode(lines[1]))
    assert cont.tokens_read - read_before == len(tok.encode(lines[1])) + n
    monkeypatch.undo()

    first = one_call(model, None, tok.encode(lines[0]), n, 0.0, 0)
    history = tok.encode(lines[0]) + first + tok.encode(lines[1])
    second = one_call(model, None, history, n, 0.0, 0)
    expected = tok.decode(first) + "\n" + tok.decode(second) + "\n"
    assert out.getvalue() == expected
    assert_state_is_the_whole_sequence(cont, model, None, history + second)


def test_a_v0_1_run_still_generates_with_the_byte_tokenizer(capsys):
    """Runs written before tokenizers travelled with them carry no tokenizer.json: the byte
    tokenizer is theirs (vocab 256, token head), and generate decodes with it."""
    from pathlib import Path

    from bdh_train.cli import main
    from bdh_train.shared.loading import load_run

    fixture = Path(__file__).parents[1] / "fixtures" / "checkpoint_v0_1"
    _, tok, cfg = load_run(fixture)
    assert isinstance(tok, ByteTokenizer) and cfg.data.tokenizer == "bytes"
    greedy = ["--temperature", "0", "--max-new-tokens", "5", "--device", "cpu"]
    assert main(["generate", "--checkpoint", str(fixture), "--prompt", "ab", *greedy]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_the_sample_prompt_ends_on_a_whole_character():
    from bdh_train.train.evaluate import sample_prompt

    tok = ByteTokenizer()
    ids = np.array(tok.encode("añb"))  # ñ is two bytes: a prompt of 2 cuts it
    assert sample_prompt(ids[:2], tok).tolist() == tok.encode("a")
    assert sample_prompt(ids[:3], tok).tolist() == tok.encode("añ")
    assert sample_prompt(ids[1:2], tok).tolist() == ids[1:2].tolist()  # never empty


# ------------------------------------------------------------------ non-finite weights
def _with_a_nan(model):
    with torch.no_grad():
        model.encoder.view(-1)[3] = float("nan")
    return model


NAN_WEIGHTS = (
    "the weights of the model are not finite: NaN or infinity in encoder (1 of 1,024 values)"
)


def _draw_generate(model, t):
    sampling.generate(model, torch.tensor([1, 2]), 3, t, generator=torch.Generator().manual_seed(0))


def _draw_batch(model, t):
    sampling.generate_batch(model, [[1, 2], [3]], 3, t, generator=torch.Generator().manual_seed(0))


def _draw_continuation(model, t):
    cont = Continuation(model)
    cont.feed([1, 2])
    list(cont.sample(3, t, None, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draw", [_draw_generate, _draw_batch, _draw_continuation])
def test_nan_weights_are_refused_before_the_first_draw(draw, temperature):
    """Sampled, torch.multinomial failed ('probability tensor contains either inf, nan or
    element < 0'); greedy, argmax returned whatever token the NaN fell on."""
    from bdh_train.model.sampling import NonFiniteModelError

    model = _with_a_nan(tiny_model().eval())
    with pytest.raises(NonFiniteModelError) as info:
        draw(model, temperature)
    assert str(info.value) == f"{NAN_WEIGHTS}; nothing can be sampled from them"


def test_a_state_holding_nan_is_refused_with_the_logits():
    from bdh_train.model.sampling import NonFiniteModelError

    cont = Continuation(tiny_model().eval())
    cont.feed([1, 2])
    rho = cont.state.rho[0]
    assert rho is not None
    rho.view(-1)[0] = float("inf")
    cont.feed([3])
    with pytest.raises(NonFiniteModelError, match="the model's logits are not finite .* float32"):
        next(cont.sample(1, 1.0, None, torch.Generator()))


def test_the_end_of_run_sample_refuses_nan_weights():
    from bdh_train.data.config import DataConfig
    from bdh_train.data.tokens import TokenData
    from bdh_train.model.sampling import NonFiniteModelError
    from bdh_train.train.evaluate import sample_continuation

    model = _with_a_nan(tiny_model(vocab_size=256))
    data = TokenData(np.frombuffer(b"def f(x):\n    return x\n", dtype=np.uint8), 256, "t")
    args = (model, ByteTokenizer(), model.config, DataConfig(), (data, None), torch.device("cpu"))
    with pytest.raises(NonFiniteModelError, match="the weights of the trained model are not"):
        sample_continuation(*args)
    with pytest.raises(NonFiniteModelError, match="the weights of checkpoint RUN/step-3 are"):
        sample_continuation(*args, where="checkpoint RUN/step-3")


def test_score_text_is_the_mean_loss_of_each_token_given_the_text_before_it():
    """`score_text` (read 16 tokens a call, the state carried) against one forward pass:
    -log p(token | text before it) averaged over every token after the first, and the sum in
    bits over the UTF-8 bytes of those tokens (a BPE: tokens of several bytes, some
    characters cut between tokens)."""
    import math

    from helpers import BPE_TEXT

    from bdh_train import score_text
    from bdh_train.data.tokenizer import train_bpe

    tok = train_bpe([BPE_TEXT], 300)
    model = tiny_model(torch.float64, vocab_size=tok.vocab_size).eval()
    text = BPE_TEXT[:130]
    ids = tok.encode(text)
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    nll = -torch.log_softmax(logits[0], -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    text_bytes = sum(len(tok.decode_bytes([t])) for t in ids[1:])
    score = score_text(model, tok, text, chunk_tokens=16)
    assert score.tokens == len(ids) - 1 > 32  # three calls at least
    assert score.loss == pytest.approx(float(nll.mean()), rel=1e-10)
    assert score.bits_per_byte == pytest.approx(
        float(nll.sum()) / math.log(2) / text_bytes, rel=1e-10
    )
    assert text_bytes > score.tokens  # bits per byte differs from bits per token here
    with pytest.raises(DataError, match="scoring needs at least 2"):
        score_text(model, tok, "R")


def _hand_made_state(tmp_path, change) -> tuple[Continuation, object]:
    """A state saved by a 2-layer model, its tensors then changed by `change(tensors)` and
    written back with the same metadata: a hand-made --load-state file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model().eval()
    saver = Continuation(model)
    saver.feed([1, 2, 3])
    path = saver.save(tmp_path / "state.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    change(tensors)
    save_file(tensors, str(path), metadata=meta)
    return Continuation(model), path


HAND_MADE_STATES = {
    "rho of the wrong shape": (
        lambda t: t.update({"state.rho.0": t["state.rho.0"][:, :, :5].clone()}),
        "'state.rho.0' has shape [1, 2, 5, 16], the model's [1, 2, 32, 16]",
    ),
    "rho as int8": (
        lambda t: t.update({"state.rho.1": t["state.rho.1"].to(torch.int8)}),
        "'state.rho.1' is torch.int8, not a floating dtype",
    ),
    "position as int8": (
        lambda t: t.update({"state.position": t["state.position"].to(torch.int8)}),
        "'state.position' is torch.int8, not torch.int64",
    ),
    "a NaN in rho": (
        lambda t: t["state.rho.0"].view(-1).__setitem__(7, float("nan")),
        "'state.rho.0' holds NaN or infinity",
    ),
    "an infinite hidden": (
        lambda t: t["hidden"].view(-1).__setitem__(0, float("inf")),
        "'hidden' holds NaN or infinity",
    ),
    "an empty hidden": (
        lambda t: t.update({"hidden": torch.zeros(1, 0, 16)}),
        "'hidden' has shape [1, 0, 16], the model's [1, 1, 16]",
    ),
    "a missing layer": (lambda t: t.pop("state.rho.1"), "it has no tensor 'state.rho.1'"),
    "no hidden": (lambda t: t.pop("hidden"), "it has no tensor 'hidden'"),
    "a layer too many": (
        lambda t: t.update({"state.rho.2": t["state.rho.0"].clone()}),
        "it has an unexpected tensor 'state.rho.2'",
    ),
    "a negative position": (
        lambda t: t.update({"state.position": torch.tensor([-4])}),
        "its position is -4, and a saved state has read at least 1 token",
    ),
    "position 0": (
        lambda t: t.update({"state.position": torch.tensor([0])}),
        "its position is 0, and a saved state has read at least 1 token",
    ),
}


@pytest.mark.parametrize("case", list(HAND_MADE_STATES))
def test_a_hand_made_state_file_is_refused_naming_what_is_wrong(tmp_path, case):
    change, wrong = HAND_MADE_STATES[case]
    cont, path = _hand_made_state(tmp_path, change)
    with pytest.raises(CheckpointError) as refused:
        cont.load(path)
    assert str(refused.value) == f"{path} is not a generation state of this checkpoint: {wrong}"
    assert cont.hidden is None and cont.tokens_read == 0  # nothing was loaded


@pytest.mark.timeout(30)
def test_a_state_file_that_is_a_fifo_or_too_large_is_refused_before_reading(
    tmp_path, bounded_memory
):
    import os

    cont, path = _hand_made_state(tmp_path, lambda t: None)
    fix = "give a file written by --save-state for this checkpoint"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError) as refused:
        cont.load(fifo)
    assert str(refused.value) == (
        f"state file {fifo} is a FIFO (named pipe), not a regular file; {fix}"
    )
    size = path.stat().st_size
    with open(path, "ab") as grown:  # 1 GiB more, sparse: read whole, it would not fit
        grown.truncate(size + (1 << 30))
    with pytest.raises(CheckpointError) as refused:
        cont.load(path)
    assert str(refused.value).startswith(f"state file {path} has {size + (1 << 30)} bytes, more")


class _ScriptedContinuation:
    """A Continuation whose replies are given: each `sample` yields the next script's bytes."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies, self.fed = iter(replies), []

    def feed(self, ids):
        self.fed.append(list(ids))

    def sample(self, max_new_tokens, temperature, top_k, generator):
        yield from list(next(self.replies))[:max_new_tokens]


SCRIPT = [b"hello wor", b"ok.\nbye!", b"the en"]
"""Three replies of a 9-token limit: cut in a word; ended by the stop '!'; 6 tokens, short."""


def _chat(style: str) -> str:
    out = io.StringIO()
    lines = ["hi\n", "more\n", "end\n"]
    cont = _ScriptedContinuation(SCRIPT)
    stops = {ord("!")}
    assert (
        chat(cont, ByteTokenizer(), lines, out, 9, 0.0, None, None, stops=stops, style=style) == 3
    )
    assert cont.fed == [list(line.encode()) for line in lines]
    return out.getvalue()


def test_a_piped_chat_ends_each_reply_with_a_line_saying_when_it_was_cut():
    assert _chat("pipe") == (
        "hello wor\n--- end of reply 1: cut mid-word at the limit of 9 tokens ---\n"
        "ok.\nbye\n--- end of reply 2 ---\n"
        "the en\n--- end of reply 3 ---\n"
    )
    assert _chat("terminal") == "hello wor\nok.\nbye\nthe en\n"  # the prompt is ""


def test_chat_jsonl_is_one_object_a_turn():
    turns = [json.loads(line) for line in _chat("jsonl").splitlines()]
    assert turns == [
        {"turn": 1, "input": "hi", "reply": "hello wor", "tokens": 9, "stop": None, "cut": True},
        {"turn": 2, "input": "more", "reply": "ok.\nbye", "tokens": 7, "stop": "!", "cut": False},
        {"turn": 3, "input": "end", "reply": "the en", "tokens": 6, "stop": None, "cut": False},
    ]


def test_a_field_added_at_its_earlier_value_leaves_the_config_hash_as_it_was():
    """States saved before model.token_shift existed hold the hash of a config without it:
    at its default the field is left out, so they still load; turned on, it changes the hash."""
    config = tiny_model().config
    before = {k: v for k, v in config.to_dict().items() if k not in LATER_FIELDS}
    text = json.dumps(before, sort_keys=True)
    assert config_hash(config) == hashlib.sha256(text.encode()).hexdigest()
    assert config_hash(dataclasses.replace(config, token_shift=True)) != config_hash(config)
