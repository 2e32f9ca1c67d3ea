"""The inference side of the command line: --help without torch, --version, defaults in the
help, sampling arguments refused with one line, --device/--threads, generate --save-state /
--load-state, and chat."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys

import pytest
from helpers import MICRO, assert_close

import bdh_train
from bdh_train.cli import COMMANDS, build_parser, main
from bdh_train.cli.args import DEVICES
from bdh_train.model import sampling
from bdh_train.storage import checkpoint as ckpt


def test_the_cli_and_its_help_import_no_torch():
    script = (
        "import sys, argparse\n"
        "import bdh_train.cli as cli\n"
        "parser = cli.build_parser()\n"
        "parser.format_help()\n"
        "for action in parser._actions:\n"
        "    if isinstance(action, argparse._SubParsersAction):\n"
        "        for sub in action.choices.values(): sub.format_help()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "print(bad[:5])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"bdh-train {bdh_train.__version__}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for expected in ("(default: 0.8)", "0 = greedy", "(default: auto)", "--save-state FILE"):
        assert expected in help_text


def test_device_choices_are_those_of_the_training_config():
    from bdh_train.train.config import DEVICES as TRAINING_DEVICES

    assert DEVICES == TRAINING_DEVICES
    assert build_parser().parse_args(["eval", "--checkpoint", "x"]).device == "auto"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "bdh-train: the following arguments are required: command; see 'bdh-train --help'"),
        (["frob"], "bdh-train: argument command: invalid choice: 'frob' (choose from 'train', "),
        (["eval"], "bdh-train eval: the following arguments are required: --checkpoint; see "),
        (["generate", "--checkpoint", "x", "--temperature", "hot"], "invalid float value: 'hot'"),
    ],
)
def test_an_argument_error_is_one_error_line(capsys, argv, message):
    """argparse's refusal is the one `error:` line of every refusal (not its usage block)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_every_command_of_the_parser_has_its_function():
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--top-k", "0"], "--top-k must be a positive integer"),
        (["--top-k", "-5"], "--top-k must be a positive integer"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
        (["--threads", "-2"], "--threads must be a non-negative integer, got -2"),
        (["--threads", "100000"], "--threads = 100000 is more than this machine's"),
        (["--seed", str(2**64)], "--seed must be an integer from -2**63 to 2**64 - 1"),
        (["--seed", str(-(2**63) - 1)], "--seed must be an integer from -2**63 to 2**64 - 1"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_sampling_arguments_are_one_line(tmp_path, capsys, command, bad, message):
    # refused before the (missing) checkpoint is even looked at
    assert main([command, "--checkpoint", str(tmp_path / "none"), *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    assert main(["train", "--run-dir", str(path), *MICRO]) == 0
    return path


def test_load_run_gives_the_model_in_eval_mode(run_dir):
    """Dropout off in every module (generate, eval, inspect and the exports read a run
    through load_run): with dropout 0.5, two reads of one text give the same logits."""
    import dataclasses

    import torch

    from bdh_train.shared.loading import load_run

    model, _, _ = load_run(run_dir)
    assert not any(m.training for m in model.modules())
    model.config = dataclasses.replace(model.config, dropout=0.5)
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(model(ids)[0], model(ids)[0])


def _generate(capsys, run_dir, *args: str) -> str:
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run_dir), "--device", "cpu", *args]) == 0
    return capsys.readouterr().out


def test_temperature_zero_is_greedy_whatever_the_seed(run_dir, capsys):
    greedy = ["--temperature", "0", "--max-new-tokens", "10"]
    assert _generate(capsys, run_dir, *greedy, "--seed", "1") == _generate(
        capsys, run_dir, *greedy, "--seed", "2"
    )


def test_threads_sets_torch_threads(run_dir, capsys):
    import torch

    before = torch.get_num_threads()
    try:
        _generate(capsys, run_dir, "--threads", "1", "--max-new-tokens", "2")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_save_state_then_load_state_equals_the_whole_prompt(run_dir, tmp_path, capsys):
    first, second = "class Foo:\n    def __init__(self):\n" * 3, "        self."
    state = tmp_path / "doc.state"
    greedy = ["--temperature", "0", "--max-new-tokens", "16"]
    assert (
        _generate(
            capsys, run_dir, "--prompt", first, "--save-state", str(state), "--max-new-tokens", "0"
        )
        == first + "\n"
    )
    resumed = _generate(capsys, run_dir, "--load-state", str(state), "--prompt", second, *greedy)
    whole = _generate(capsys, run_dir, "--prompt", first + second, *greedy)
    assert resumed.startswith(second) and whole.startswith(first + second)
    assert resumed[len(second) :] == whole[len(first + second) :]
    assert len(resumed) > len(second) + 1


def test_an_empty_prompt_reads_a_newline_when_its_state_is_saved_too(run_dir, tmp_path, capsys):
    """--prompt '' reads a newline (the one-call path does), also with --save-state."""
    state = tmp_path / "empty.state"
    greedy = ["--temperature", "0", "--max-new-tokens", "6"]
    saved = _generate(capsys, run_dir, "--prompt", "", "--save-state", str(state), *greedy)
    assert saved == _generate(capsys, run_dir, "--prompt", "\n", *greedy)
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(run_dir),
                "--prompt",
                "",
                "--save-state",
                str(state),
                "--max-new-tokens",
                "0",
                "--force",
            ]
        )
        == 0
    )
    assert "saved the state after 1 tokens" in capsys.readouterr().err


NOT_UTF8 = "a\udcffb"  # how Python holds the bytes b"a\xffb" read as a command-line argument


@pytest.mark.parametrize(
    "extra, where",
    [
        (["--prompt", NOT_UTF8], "--prompt"),
        (["--prompt", NOT_UTF8, "--save-state", "STATE"], "--prompt"),
        (["--prompt", "a", "--stop", NOT_UTF8], f"--stop {NOT_UTF8!r}"),
    ],
    ids=["prompt", "prompt-saved", "stop"],
)
def test_generate_text_that_is_not_utf8_is_one_line(run_dir, tmp_path, capsys, extra, where):
    state = tmp_path / "s.state"
    extra = [str(state) if a == "STATE" else a for a in extra]
    assert main(["generate", "--checkpoint", str(run_dir), "--device", "cpu", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and not state.exists()
    assert err == (
        f"error: {where} holds '\\udcff', which is not text (a lone surrogate escape); remove it\n"
    )


def test_a_chat_line_that_is_not_utf8_is_one_line(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"ok\n{NOT_UTF8}\n"))
    greedy = ["--temperature", "0", "--max-new-tokens", "2", "--device", "cpu"]
    assert main(["chat", "--checkpoint", str(run_dir), *greedy]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: line 2 of the chat input holds '\\udcff', which is not text (a lone "
        "surrogate escape); remove it\n"
    )


def test_a_checkpoint_whose_weights_are_not_safetensors_is_one_line(tmp_path, capsys):
    """A directory holding a model.safetensors that is not one, under a manifest that matches
    it (without a manifest it is refused before it is read: tests/storage/test_checkpoint_trust)."""
    (tmp_path / "model.safetensors").write_bytes(b"garbage\n")
    ckpt.write_manifest(tmp_path)
    assert main(["generate", "--checkpoint", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read {tmp_path / 'model.safetensors'}: ")
    assert err.endswith("pass --checkpoint an intact checkpoint\n") and err.count("\n") == 1


def test_a_state_saved_from_another_model_is_refused(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    wider = [
        *MICRO,
        "--set",
        "model.n_embd=16",
        "--set",
        "training.max_steps=1",
        "--set",
        "training.checkpoint_every=1",
        "--set",
        "training.eval_every=0",
    ]
    assert main(["train", "--run-dir", str(other), *wider]) == 0
    state = tmp_path / "s.state"
    _generate(capsys, other, "--prompt", "abc", "--save-state", str(state), "--max-new-tokens", "0")
    assert main(["generate", "--checkpoint", str(run_dir), "--load-state", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "another config" in err


def _replies(out: str) -> list[str]:
    """A piped chat's lines without the lines that end its replies."""
    return [line for line in out.split("\n") if not line.startswith("--- end of reply ")]


def test_chat_turns_continue_one_state(run_dir, capsys, monkeypatch):
    turns = ["def add(a, b):\n", "    return\n"]
    greedy = ["--temperature", "0", "--max-new-tokens", "6", "--device", "cpu"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(turns)))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(run_dir), *greedy]) == 0
    replies = _replies(capsys.readouterr().out)
    # the second reply is what generate gives on the whole conversation so far (in tokens: an
    # untrained model's bytes need not be valid UTF-8, so its text does not round-trip)
    import torch

    model, tok, _ = bdh_train.load_run(run_dir)

    def greedy_tokens(prompt: list[int]) -> list[int]:
        return sampling.generate(model, torch.tensor(prompt), 6, temperature=0)[
            len(prompt) :
        ].tolist()

    first = greedy_tokens(tok.encode(turns[0]))
    second = greedy_tokens(tok.encode(turns[0]) + first + tok.encode(turns[1]))
    assert replies[:3] == [tok.decode(first), tok.decode(second), ""]


def test_chat_jsonl_prints_one_object_a_turn(run_dir, capsys, monkeypatch):
    turns = ["def add(a, b):\n", "    return\n"]
    greedy = ["--temperature", "0", "--max-new-tokens", "6", "--device", "cpu", "--jsonl"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(turns)))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(run_dir), *greedy]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["turn"], r["input"], r["tokens"], r["stop"]) for r in rows] == [
        (1, "def add(a, b):", 6, None),
        (2, "    return", 6, None),
    ]


def test_chat_save_state_equals_generate_save_state_for_the_same_text(
    run_dir, tmp_path, capsys, monkeypatch
):
    """The state chat saves when the conversation ends is the one generate --save-state saves
    after reading the same text (the lines typed, each read on top of the ones before)."""
    from safetensors.torch import load_file

    turns = ["def add(a, b):\n", "    return\n"]
    chat_state, generate_state = tmp_path / "chat.state", tmp_path / "generate.state"
    quiet = ["--max-new-tokens", "0", "--device", "cpu"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(turns)))
    argv = ["chat", "--checkpoint", str(run_dir), *quiet, "--save-state", str(chat_state)]
    assert main(argv) == 0
    prompt = ["--prompt", "".join(turns), "--max-new-tokens", "0"]
    _generate(capsys, run_dir, *prompt, "--save-state", str(generate_state))
    chat_tensors, generate_tensors = load_file(chat_state), load_file(generate_state)
    assert set(chat_tensors) == set(generate_tensors)
    for name, tensor in chat_tensors.items():
        assert_close(tensor, generate_tensors[name], rtol=1e-5, atol=1e-6, msg=name)


def _cut_at(tokens: list[int], stop: int) -> list[int]:
    return tokens[: tokens.index(stop)] if stop in tokens else tokens


def test_a_stop_ends_chat_replies_unread(run_dir, capsys, monkeypatch):
    """With --stop, each reply is the greedy reply cut before the stop's first place, and the
    next turn continues from the conversation without the stop token (it is not read into the
    state)."""
    import torch

    model, tok, _ = bdh_train.load_run(run_dir)

    def greedy_tokens(prompt: list[int]) -> list[int]:
        return sampling.generate(model, torch.tensor(prompt), 12, temperature=0)[
            len(prompt) :
        ].tolist()

    turns = ["def add(a, b):\n", "    return\n"]
    plain = greedy_tokens(tok.encode(turns[0]))
    stop = next(t for t in plain[1:] if t < 128 and t != plain[0])  # an ASCII byte
    first = _cut_at(plain, stop)
    second = _cut_at(greedy_tokens(tok.encode(turns[0]) + first + tok.encode(turns[1])), stop)
    greedy = ["--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(turns)))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", str(run_dir), *greedy, "--stop", chr(stop)]) == 0
    replies = _replies(capsys.readouterr().out)
    assert 0 < len(first) < len(plain)
    assert replies[:3] == [tok.decode(first), tok.decode(second), ""]


def test_chat_does_not_read_a_stop_into_the_state(run_dir):
    """After two turns of `inference.chat` with a stop, the continuation's state is that of a
    fresh one fed the turns and the replies without the stop token: the same token count,
    state and last output."""
    import torch

    from bdh_train.generation.chat import chat
    from bdh_train.generation.continuation import Continuation

    model, tok, _ = bdh_train.load_run(run_dir)
    turns = ["def add(a, b):\n", "    return\n"]
    probe = Continuation(model)
    probe.feed(tok.encode(turns[0]))
    plain = list(probe.sample(12, temperature=0.0))
    stop = next(t for t in plain[1:] if t != plain[0])
    first = _cut_at(plain, stop)
    probe = Continuation(model)  # the second reply, greedy after the first without the stop
    probe.feed(tok.encode(turns[0]) + first + tok.encode(turns[1]))
    second = _cut_at(list(probe.sample(12, temperature=0.0)), stop)
    out = io.StringIO()
    cont = Continuation(model)
    assert chat(cont, tok, turns, out, 12, 0.0, None, torch.Generator(), stops={stop}) == 2
    assert out.getvalue().split("\n")[:2] == [tok.decode(first), tok.decode(second)]
    assert 0 < len(first) < len(plain)
    fresh = Continuation(model)
    read = tok.encode(turns[0]) + first + tok.encode(turns[1]) + second
    fresh.feed(read)
    assert cont.tokens_read == fresh.tokens_read == len(read)
    for got, want in zip(cont.state.rho, fresh.state.rho, strict=True):
        assert_close(got, want, rtol=1e-5)
    assert_close(cont.hidden, fresh.hidden, rtol=1e-5)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("stop, count", [("ab", 2), ("", 0)])
def test_a_stop_of_other_than_one_token_is_one_line(run_dir, capsys, command, stop, count):
    assert main([command, "--checkpoint", str(run_dir), "--stop", stop]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: --stop {stop!r} is {count} tokens in this run's tokenizer")


def test_a_stop_ends_generate_and_its_continuation_alike(run_dir, tmp_path, capsys):
    """generate --prompt with --stop prints the greedy text before the stop's first place
    (not the stop); from a saved state (`Continuation.sample`) it ends at the same place."""
    import torch

    model, tok, _ = bdh_train.load_run(run_dir)
    prompt = "def add(a, b):\n"
    ids = tok.encode(prompt)
    plain = sampling.generate(model, torch.tensor(ids), 12, temperature=0)[len(ids) :].tolist()
    stop = next(t for t in plain[1:] if t < 128 and t != plain[0])
    cut = tok.decode(_cut_at(plain, stop))
    greedy = ["--temperature", "0", "--max-new-tokens", "12", "--stop", chr(stop)]
    assert _generate(capsys, run_dir, "--prompt", prompt, *greedy) == prompt + cut + "\n"
    state = tmp_path / "prompt.state"
    _generate(
        capsys, run_dir, "--prompt", prompt, "--save-state", str(state), "--max-new-tokens", "0"
    )
    assert _generate(capsys, run_dir, "--load-state", str(state), *greedy) == cut + "\n"


def test_until_stop_closes_the_stream_it_stops():
    from bdh_train.generation.chat import until_stop

    closed = []

    def stream():
        try:
            yield from (1, 2, 3, 4)
        finally:
            closed.append(True)

    assert list(until_stop(stream(), {3})) == [1, 2] and closed == [True]
    assert list(until_stop([5, 6], {3})) == [5, 6]


def test_training_threads_sets_torch_threads(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        one = [
            "--set",
            "training.threads=1",
            "--set",
            "training.max_steps=1",
            "--set",
            "training.eval_every=0",
            "--set",
            "training.checkpoint_every=1",
        ]
        assert main(["train", "--run-dir", str(tmp_path / "a"), *MICRO, *one]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["train", "--run-dir", str(tmp_path / "b"), "--set", "training.threads=-1"]) == 2
    assert "training.threads must be a non-negative integer" in capsys.readouterr().err


def _prompts_file(tmp_path, lines: list[str], name: str = "prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _complete(capsys, run_dir, prompts, *args: str) -> list[dict]:
    import json

    out = _generate(capsys, run_dir, "--prompts-file", str(prompts), *args)
    return [json.loads(line) for line in out.splitlines()]


GREEDY_8 = ["--temperature", "0", "--max-new-tokens", "8"]


def test_a_prompts_file_completes_each_prompt_as_generate_does_alone(run_dir, tmp_path, capsys):
    """Four prompts of different lengths (an empty one: a newline, as for `generate`) in
    batches of 3 (two batches), a blank line skipped and an extra key copied: each greedy
    completion is what `generate --prompt` prints after that prompt, and the records come
    back in the file's order."""
    import json

    texts = ["def add(a, b):\n", "x", "class Foo:\n    pass\n\n# a comment", ""]
    lines = [json.dumps({"id": i, "prompt": t}) for i, t in enumerate(texts)]
    prompts = _prompts_file(tmp_path, [lines[0], "", *lines[1:]])
    got = _complete(capsys, run_dir, prompts, *GREEDY_8, "--batch-size", "3")
    assert [record["id"] for record in got] == [0, 1, 2, 3]
    for text, record in zip(texts, got, strict=True):
        alone = _generate(capsys, run_dir, "--prompt", text, *GREEDY_8)
        assert record["prompt"] == text and record["stop"] is None
        assert alone == text + record["completion"] + "\n"
        assert len(record["completion"]) > 0


def test_a_stop_text_ends_the_completions_that_sample_it(run_dir, tmp_path, capsys):
    """The stop is a character the first prompt's greedy completion samples after its first
    one: each completion ends before the stop's first place in it (the stop left out, "stop"
    naming it), and one that never samples it runs to the token limit as without the stop."""
    import json

    texts = ["def add(a, b):\n", "0123456789"]
    prompts = _prompts_file(tmp_path, [json.dumps({"prompt": t}) for t in texts])
    plain = _complete(capsys, run_dir, prompts, *GREEDY_8)
    completion = plain[0]["completion"]
    # an ASCII character (one byte: one token) other than the first
    stop = next(c for c in completion[1:] if c.isascii() and c != completion[0])
    stopped = _complete(capsys, run_dir, prompts, *GREEDY_8, "--stop", stop)
    for text, before, after in zip(texts, plain, stopped, strict=True):
        if stop in before["completion"]:
            cut = before["completion"][: before["completion"].index(stop)]
            assert after == {"prompt": text, "completion": cut, "stop": stop}
        else:
            assert after == before and after["stop"] is None
    assert stopped[0]["completion"] != ""  # the stop came after the first character


def test_stops_at_the_first_token_two_stops_and_no_new_tokens(run_dir, tmp_path, capsys):
    """A stop sampled as the first new token gives an empty completion; of two stops the
    first sampled ends it; with --max-new-tokens 0 nothing is sampled and no stop is met."""
    import json

    candidates = ["x", "0123456789", "def add(a, b):\n", "class Foo:\n", " ", "a = 1\n"]
    every = _complete(
        capsys,
        run_dir,
        _prompts_file(
            tmp_path, [json.dumps({"prompt": t}) for t in candidates], "candidates.jsonl"
        ),
        *GREEDY_8,
    )
    # a prompt whose completion starts with an ASCII character (one byte: one token) and
    # holds another one later
    plain = next(
        r
        for r in every
        if r["completion"][0].isascii()
        and any(c.isascii() and c != r["completion"][0] for c in r["completion"][1:])
    )
    prompts = _prompts_file(tmp_path, [json.dumps({"prompt": plain["prompt"]})])
    first = plain["completion"][0]
    later = next(c for c in plain["completion"][1:] if c.isascii() and c != first)
    (got,) = _complete(capsys, run_dir, prompts, *GREEDY_8, "--stop", first)
    assert got["completion"] == "" and got["stop"] == first
    (got,) = _complete(capsys, run_dir, prompts, *GREEDY_8, "--stop", later, "--stop", first)
    assert got["completion"] == "" and got["stop"] == first
    none = ["--temperature", "0", "--max-new-tokens", "0", "--stop", first]
    (got,) = _complete(capsys, run_dir, prompts, *none)
    assert got == {"prompt": plain["prompt"], "completion": "", "stop": None}


def test_a_byte_order_mark_and_crlf_lines_read_as_plain_lines(run_dir, tmp_path, capsys):
    plain = _prompts_file(tmp_path, ['{"prompt": "ab"}', '{"prompt": "cd"}'])
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b'\xef\xbb\xbf{"prompt": "ab"}\r\n{"prompt": "cd"}\r\n')
    assert _complete(capsys, run_dir, marked, *GREEDY_8) == _complete(
        capsys, run_dir, plain, *GREEDY_8
    )


def test_a_prompt_of_no_tokens_is_refused_with_its_line(tmp_path):
    """A tokenizer without a token for a prompt's characters (a subword vocabulary without
    byte fallback encodes them to nothing) is refused before anything is generated."""
    from bdh_train.data.tokenizer import ByteTokenizer
    from bdh_train.errors import DataError
    from bdh_train.generation.completions import read_prompts

    class Sparse(ByteTokenizer):
        def encode(self, text):
            return [b for b in super().encode(text) if b != ord("Z")]

    prompts = _prompts_file(tmp_path, ['{"prompt": "a"}', '{"prompt": "ZZ"}'])
    with pytest.raises(DataError) as refused:
        read_prompts(prompts, Sparse())
    assert str(refused.value) == (
        f"{prompts}:2: the prompt is 0 tokens in this run's tokenizer (none of its characters "
        "has a token); write it with characters the tokenizer knows"
    )
    assert [r.ids for r in read_prompts(prompts, ByteTokenizer())] == [[97], [90, 90]]


EXAMPLE = 'each line must be an object such as {"prompt": "text"}'


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a"}', "not json"], f"2: not JSON (Expecting value, column 1); {EXAMPLE}"),
        (['["a"]'], f"1: a JSON array, not an object; {EXAMPLE}"),
        (['"a"'], f"1: a JSON string, not an object; {EXAMPLE}"),
        (['{"text": "a"}'], f'1: no "prompt" key; {EXAMPLE}'),
        (['{"prompt": 3}'], '1: "prompt" is a JSON number, not a string'),
        (['{"prompt": null}'], '1: "prompt" is a JSON null, not a string'),
        (['{"prompt": true}'], '1: "prompt" is a JSON boolean, not a string'),
        (['{"prompt": {}}'], '1: "prompt" is a JSON object, not a string'),
        (
            ['{"prompt": "a", "completion": "b"}'],
            '1: the key "completion" is one generate writes into its output; rename it in the '
            "prompts file",
        ),
        (
            ['{"prompt": "a", "x": NaN}'],
            "1: NaN is not a JSON value; write it as a string or a number",
        ),
        (
            ['{"prompt": "a"}', '{"prompt": "a\\ud800"}'],
            "2: the prompt holds '\\ud800', which is not text (a lone surrogate escape); remove it",
        ),
        (["", "  "], ': no prompts; write one JSON object a line, such as {"prompt": "text"}'),
    ],
)
def test_a_bad_prompts_file_is_one_line_and_prints_nothing(
    run_dir, tmp_path, capsys, lines, message
):
    prompts = _prompts_file(tmp_path, lines)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run_dir), "--prompts-file", str(prompts)]) == 2
    out, err = capsys.readouterr()
    where = str(prompts) + ("" if message.startswith(":") else ":")
    assert out == "" and err == f"error: {where}{message}\n"


def test_a_prompts_file_that_is_not_utf8_or_missing_is_one_line(run_dir, tmp_path, capsys):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    missing = tmp_path / "none"
    for path, message in (
        (bad, f"{bad}:2: not UTF-8 (byte 16 of the line); save the prompts file as UTF-8"),
        (missing, f"cannot read the prompts file {missing}: No such file or directory"),
    ):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(run_dir), "--prompts-file", str(path)]) == 2
        assert capsys.readouterr() == ("", f"error: {message}\n")


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("bounded_memory")
def test_a_prompts_file_that_is_dev_zero_is_one_line_at_once(run_dir, capsys):
    """/dev/zero (a read of it never ends: the whole-file read reached 8.9 GB in 15 s) is
    refused as what it is, before anything is read or printed (memory bounded: a read
    without a bound fails fast)."""
    import time

    capsys.readouterr()
    started = time.monotonic()
    argv = ["generate", "--checkpoint", str(run_dir), "--prompts-file", "/dev/zero"]
    assert main(argv) == 2
    assert time.monotonic() - started < 60  # the model loads first; the refusal is instant
    assert capsys.readouterr() == (
        "",
        "error: the prompts file /dev/zero is a character device, not a regular file; write "
        "the prompts into a file and give its path (generate reads it twice)\n",
    )


def test_sampled_completions_follow_the_seed_and_top_k(run_dir, tmp_path, capsys):
    """At temperature 1 the completions are the seed's (the same twice, another seed's
    differ), and --top-k 1 samples the greedy ones."""
    import json

    texts = ["def add(a, b):\n", "x", "class Foo:\n"]
    prompts = _prompts_file(tmp_path, [json.dumps({"prompt": t}) for t in texts])
    sample = ["--temperature", "1", "--max-new-tokens", "8"]
    seeded = _complete(capsys, run_dir, prompts, *sample, "--seed", "3")
    assert _complete(capsys, run_dir, prompts, *sample, "--seed", "3") == seeded
    assert _complete(capsys, run_dir, prompts, *sample, "--seed", "4") != seeded
    greedy = _complete(capsys, run_dir, prompts, *GREEDY_8)
    assert _complete(capsys, run_dir, prompts, *sample, "--top-k", "1") == greedy
    assert seeded != greedy


def test_completions_with_a_summary_memory_mark_its_events():
    """A model whose summary memory has a write gate: `complete` marks the events of each
    prompt and new token as `generate_batch` does, and without the events the completions
    differ (so the events reach the model)."""
    import torch
    from helpers import tiny_model

    from bdh_train.generation.completions import PromptRecord, complete
    from bdh_train.model.config import SummaryMemoryConfig

    class Digits:  # a tokenizer of the digits 0-9
        def encode(self, text):
            return [int(c) for c in text]

        def decode(self, ids):
            return "".join(str(i) for i in ids)

    class Sevens:  # a summary event at every token 7
        history_len = 0

        def mask(self, inputs, history=None):
            return (inputs == 7).to(torch.float32)

    memory = SummaryMemoryConfig(enabled=True, chunk_tokens=2, write_gate=True)
    model = tiny_model(torch.float64, summary_memory=memory).eval()
    with torch.no_grad():
        for p in model.parameters():  # a memory strong enough to change greedy tokens
            p.mul_(3.0)
    prompts = ["7717", "2777", "77"]
    records = [PromptRecord({"prompt": p}, Digits().encode(p)) for p in prompts]
    sample = dict(temperature=0.0, top_k=None, generator=None, stops={})
    got = list(complete(model, Digits(), records, 8, 2, summary_events=Sevens(), **sample))
    want = sampling.generate_batch(model, [r.ids for r in records], 8, 0.0, summary_events=Sevens())
    assert [g["completion"] for g in got] == [
        Digits().decode(w[len(r.ids) :].tolist()) for w, r in zip(want, records, strict=True)
    ]
    plain = list(complete(model, Digits(), records, 8, 2, summary_events=None, **sample))
    assert plain != got


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "x"], "--prompts-file and --prompt do not combine"),
        (["--save-state", "s"], "--prompts-file and --save-state do not combine"),
        (["--load-state", "s"], "--prompts-file and --load-state do not combine"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--stop", "ab"], "--stop 'ab' is 2 tokens"),
    ],
)
def test_prompts_file_options_that_do_not_fit_are_refused(
    run_dir, tmp_path, capsys, extra, message
):
    prompts = _prompts_file(tmp_path, ['{"prompt": "a"}'])
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(run_dir), "--prompts-file", str(prompts), *extra]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {message}")


def test_batch_size_without_a_prompts_file_is_refused(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--batch-size", "4"]) == 2
    assert capsys.readouterr().err.startswith("error: --batch-size applies to --prompts-file")


# ------------------------------------------------------------------ non-finite weights
def _checkpoint_with_a_nan(run_dir, directory):
    """(directory, encoder weights) of a copy of the run's latest checkpoint (its
    model.safetensors alone, with a manifest that matches it) with one weight of the encoder
    NaN."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bdh_train.storage import checkpoint as ckpt

    source = ckpt.resolve_checkpoint(run_dir) / ckpt.MODEL_FILE
    with safe_open(str(source), "pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (not a dict)
    tensors["encoder"].view(-1)[5] = float("nan")
    directory.mkdir()
    save_file(tensors, str(directory / ckpt.MODEL_FILE), metadata=meta)
    ckpt.write_manifest(directory)
    return directory, tensors["encoder"].numel()


@pytest.mark.parametrize(
    "command, extra",
    [
        ("generate", []),
        ("generate", ["--temperature", "0"]),
        ("generate", ["--save-state", "STATE"]),
        ("generate", ["--prompts-file", "PROMPTS"]),
        ("chat", []),
    ],
    ids=["generate", "greedy", "save_state", "prompts_file", "chat"],
)
def test_a_checkpoint_with_nan_weights_is_one_line(
    run_dir, tmp_path, capsys, monkeypatch, command, extra
):
    """Sampled, torch failed inside multinomial ('probability tensor contains either inf,
    nan or element < 0'); greedy, argmax printed whatever token the NaN fell on."""
    bad, weights = _checkpoint_with_a_nan(run_dir, tmp_path / "nan")
    prompts = _prompts_file(tmp_path, ['{"prompt": "a"}'])
    extra = [{"STATE": str(tmp_path / "state"), "PROMPTS": str(prompts)}.get(a, a) for a in extra]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    capsys.readouterr()
    assert main([command, "--checkpoint", str(bad), "--device", "cpu", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "state").exists()
    assert err == (
        f"error: the weights of checkpoint {bad} are not finite: NaN or infinity in encoder "
        f"(1 of {weights:,} values); nothing can be sampled from them\n"
    )


def test_a_state_file_holding_nan_is_one_line(run_dir, tmp_path, capsys):
    """Finite weights, a state that is not: refused when loaded, naming the tensor."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    state = tmp_path / "state"
    _generate(capsys, run_dir, "--prompt", "ab", "--save-state", str(state))
    with safe_open(str(state), "pt") as handle:
        meta = handle.metadata()
    tensors = load_file(str(state))
    tensors["state.rho.0"].view(-1)[0] = float("nan")
    save_file(tensors, str(state), metadata=meta)
    args = ["generate", "--checkpoint", str(run_dir), "--device", "cpu", "--load-state"]
    assert main([*args, str(state), "--prompt", "c"]) == 2
    assert capsys.readouterr().err == (
        f"error: {state} is not a generation state of this checkpoint: 'state.rho.0' holds NaN "
        "or infinity\n"
    )


@pytest.mark.parametrize("state", [[], ["--save-state", "{tmp}/s.state"]])
def test_generate_stopped_by_ctrl_c_ends_its_line(run_dir, tmp_path, capsys, monkeypatch, state):
    """Ctrl-C in the middle of a completion: the text so far ends with a newline, so the
    "interrupted" on stderr (and the shell's prompt) start lines of their own."""
    from bdh_train.generation import continuation as inference

    def two_then_ctrl_c(self, *args, **kwargs):
        yield from (ord("a"), ord("b"))
        raise KeyboardInterrupt

    monkeypatch.setattr(sampling, "stream_generate", two_then_ctrl_c)
    monkeypatch.setattr(inference.Continuation, "sample", two_then_ctrl_c)
    capsys.readouterr()
    extra = [a.format(tmp=tmp_path) for a in state]
    argv = ["generate", "--checkpoint", str(run_dir), "--device", "cpu", "--prompt", "x", *extra]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out == "xab\n" and captured.err.endswith("interrupted\n")


@pytest.mark.parametrize(
    "command",
    [["generate"], ["chat"], ["eval"], ["inspect", "--out", "{tmp}/report"]],
    ids=["generate", "chat", "eval", "inspect"],
)
def test_threads_0_takes_the_automatic_count_in_every_command(tmp_path, monkeypatch, command):
    """--threads 0 (the default) is the count `set_threads` picks from the load, as its help
    says, in each command that loads a checkpoint: with 1.5 of 2 CPUs busy it is 1, down from
    torch's 2. The count is set before the checkpoint is read (this one does not exist)."""
    import torch

    from bdh_train.shared import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "read_loadavg", lambda: "1.50 1.20 1.00 3/200 1\n")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        argv = [a.format(tmp=tmp_path) for a in command]
        missing = str(tmp_path / "no-run")
        assert main([*argv, "--checkpoint", missing, "--device", "cpu", "--threads", "0"]) == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
