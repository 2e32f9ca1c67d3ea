"""The lm-evaluation-harness backend (`bdh_train.evals.lm_eval`, model `bdh`): a local YAML task
JSON lines written here (no download) run through `lm_eval.simple_evaluate`, its per-request
log-likelihoods against a hand loop of one model call per request, rolling perplexity with
the state carried against the model's loss over the whole document in one call (and the
disjoint windows against a hand loop of their own), generation against `sampling.generate`,
and the refusals.

Float64 models, so the backend's batching, padding and chunking are checked at 1e-10 (the
acceptance asks 1e-6); the by-name path loads the float32 checkpoint and is checked against
the hand loop on the same weights at fp32's 1e-5.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, tiny_model

from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.errors import BDHTrainError, ConfigError
from bdh_train.evals import scoring
from bdh_train.model import sampling
from bdh_train.shared.loading import load_run

NEWLINE = 10
"""The byte tokenizer's document separator: what a document is predicted after."""

DOCS = [
    {"ctx": "The cat sat on the", "choices": [" mat", " dog", " moon"], "label": 0},
    {"ctx": "def add(a, b):\n    return", "choices": [" a + b", " None"], "label": 0},
    {"ctx": "Two plus two is ", "choices": ["four", "five", "a number"], "label": 0},
]
TEXTS = [
    "import os\n" * 9 + "print(os.getcwd())\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n" * 2,
    "short",
]

CHOICE_TASK = """task: bdh_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
ROLLING_TASK = """task: bdh_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval imported once (slow), offline, with the two tasks written into a folder; its
    environment report (pip and git run in subprocesses: seconds) is left out."""
    tmp = tmp_path_factory.mktemp("lm-eval")
    env = {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp / "datasets-cache"),
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    import bdh_train.evals.lm_eval as backend

    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "rolling.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tasks / "choice.yaml").write_text(CHOICE_TASK.format(data=tasks / "choice.jsonl"))
    (tasks / "rolling.yaml").write_text(ROLLING_TASK.format(data=tasks / "rolling.jsonl"))
    patch = pytest.MonkeyPatch()
    patch.setattr(lm_eval.evaluator, "add_env_info", lambda storage: None)
    try:
        yield SimpleNamespace(
            evaluate=lm_eval.simple_evaluate,
            backend=backend,
            tasks=TaskManager(include_path=str(tasks), include_defaults=False),
        )
    finally:
        patch.undo()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def model64():
    return tiny_model(torch.float64, seed=3, vocab_size=256)


def _samples(harness, model, task: str) -> list[dict]:
    out = harness.evaluate(model=model, tasks=[task], task_manager=harness.tasks, log_samples=True)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def _hand_loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    """One model call over context + continuation; lm-eval moves the context's trailing
    whitespace into the continuation."""
    ids = list((context + continuation).encode())
    start = len(context.rstrip().encode())
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    log_probs = torch.log_softmax(logits[0], dim=-1)
    picked = [log_probs[i - 1, ids[i]] for i in range(start, len(ids))]
    greedy = all(int(log_probs[i - 1].argmax()) == ids[i] for i in range(start, len(ids)))
    return float(sum(picked)), greedy


def test_a_local_task_scores_each_choice_as_a_hand_loop(harness, model64):
    lm = harness.backend.BDHLM(model=model64, tokenizer=ByteTokenizer(), batch_size=2)
    samples = _samples(harness, lm, "bdh_choice")
    assert [len(s["arguments"]) for s in samples] == [len(d["choices"]) for d in DOCS]
    got, want = [], []
    for sample in samples:
        for (context, continuation), [(log_prob, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            hand = _hand_loglikelihood(model64, context, continuation)
            got.append(log_prob)
            want.append(hand[0])
            assert greedy == hand[1]
    assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-10, msg="loglikelihoods")


def test_is_greedy_means_every_continuation_token_is_the_argmax(harness, model64):
    lm = harness.backend.BDHLM(model=model64, tokenizer=ByteTokenizer(), batch_size=2)
    context = list(b"The cat sat")
    greedy = sampling.generate(model64, torch.tensor(context), 3, temperature=0.0)[
        len(context) :
    ].tolist()
    other = [(t + 1) % 256 for t in greedy]
    continuations = [greedy, greedy[:1] + other[1:], other[:1] + greedy[1:], greedy[:2]]
    results = lm._loglikelihood_tokens([((None, None), context, c) for c in continuations])
    assert [greedy for _, greedy in results] == [True, False, False, True]


def _document_loss(model, text: str) -> float:
    """The model's summed loss over the document read in one call, after the separator."""
    ids = [NEWLINE, *text.encode()]
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    return float(F.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="sum"))


def _window_loss(model, text: str, length: int) -> float:
    """lm-eval's disjoint windows by hand: targets in runs of `length`, each run read from a
    fresh state with one token of context (the last run: a full window of context)."""
    seq = [NEWLINE, *text.encode()]
    total, done, n = 0.0, 0, len(seq) - 1
    while done < n:
        end = min(done + length, n)
        start = max(0, end - length)
        with torch.no_grad():
            logits, _ = model(torch.tensor([seq[start:end]]))
        scored = logits[0, done - start :]
        total += float(
            F.cross_entropy(scored, torch.tensor(seq[done + 1 : end + 1]), reduction="sum")
        )
        done = end
    return total


def test_rolling_carries_the_state_through_the_document(harness, model64, monkeypatch):
    # 256 ids x 2 rows x 7 tokens: the backend reads each document 7 tokens a call
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 256 * 2 * 7)
    carried = harness.backend.BDHLM(model=model64, tokenizer=ByteTokenizer(), batch_size=2)
    windows = harness.backend.BDHLM(
        model=model64, tokenizer=ByteTokenizer(), batch_size=2, rolling="windows", max_length=16
    )
    state = [s["resps"][0][0] for s in _samples(harness, carried, "bdh_rolling")]
    # the same requests, straight to the backend (lm-eval's own windows need no harness run)
    requests = [SimpleNamespace(args=(text,)) for text in TEXTS]
    disjoint = windows.loglikelihood_rolling(requests)
    assert_close(
        torch.tensor(state),
        torch.tensor([-_document_loss(model64, t) for t in TEXTS]),
        rtol=1e-10,
        msg="state carried = one call over the document",
    )
    assert_close(
        torch.tensor(disjoint),
        torch.tensor([-_window_loss(model64, t, 16) for t in TEXTS]),
        rtol=1e-10,
        msg="windows = lm-eval's disjoint windows by hand",
    )
    for text, a, b in zip(TEXTS, state, disjoint, strict=True):
        if len(text.encode()) > 16:  # more than one window: the windows lose the context
            assert abs(a - b) > 1e-3, (text, a, b)
        else:
            assert a == pytest.approx(b, rel=1e-12)


def test_the_bdh_model_by_name_loads_the_checkpoint(harness, byte_run):
    result = harness.evaluate(
        model="bdh",
        model_args={"checkpoint": str(byte_run), "device": "cpu"},
        tasks=["bdh_choice"],
        task_manager=harness.tasks,
        log_samples=True,
    )
    model, _, _ = load_run(byte_run)
    samples = sorted(result["samples"]["bdh_choice"], key=lambda s: s["doc_id"])
    got = [r[0][0] for s in samples for r in s["resps"]]
    want = [_hand_loglikelihood(model, *a)[0] for s in samples for a in s["arguments"]]
    assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, msg="by name (float32)")


def test_generate_until_is_greedy_generation_cut_at_the_stop(harness, model64):
    lm = harness.backend.BDHLM(model=model64, tokenizer=ByteTokenizer(), batch_size=2)
    contexts = ["def f(x):\n", "import", ""]
    stops = {"until": ["e"], "max_gen_toks": 12}
    got = lm.generate_until([SimpleNamespace(args=(c, stops)) for c in contexts])
    for context, text in zip(contexts, got, strict=True):
        prompt = torch.tensor(list(context.encode()) or [NEWLINE])
        whole = sampling.generate(model64, prompt, 12, temperature=0.0)[len(prompt) :]
        expected = bytes(whole.tolist()).decode("utf-8", errors="replace").split("e")[0]
        assert text == expected


def test_a_model_without_a_text_tokenizer_and_bad_options_are_refused(harness):
    BDHLM = harness.backend.BDHLM
    with pytest.raises(BDHTrainError, match="has no text tokenizer"):
        BDHLM(model=tiny_model(vocab_size=32), tokenizer=None)
    with pytest.raises(ConfigError, match="rolling must be one of"):
        BDHLM(model=tiny_model(vocab_size=256), tokenizer=ByteTokenizer(), rolling="sliding")
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        BDHLM(model=tiny_model(vocab_size=256), tokenizer=ByteTokenizer(), batch_size="0")
    # lm-eval's command line asks for cuda:0 by default: 'auto' where there is no such GPU
    assert harness.backend._device("cuda:0") == ("cuda:0" if torch.cuda.device_count() else "auto")
    assert harness.backend._device(None) == "auto"
    assert harness.backend._device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"\['pretrained'\] are not options"):
        BDHLM(model=tiny_model(vocab_size=256), tokenizer=ByteTokenizer(), pretrained="gpt2")


def test_model_args_batch_size_and_device_win_over_lm_eval_s_own(harness, byte_run):
    """lm-eval adds its own batch_size, max_batch_size and device (its defaults included)
    to the documented model_args: those in model_args are the ones used, from a string (the
    command line) or a dict."""
    BDHLM = harness.backend.BDHLM
    added = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    lm = BDHLM.create_from_arg_string(f"checkpoint={byte_run},batch_size=4,device=cpu", added)
    assert lm.batch_size == 4 and lm.device == torch.device("cpu")
    lm = BDHLM.create_from_arg_obj({"model": lm.model, "tokenizer": lm.tok}, added)
    assert lm.batch_size == 1  # lm-eval's own fills what model_args leave out


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_length", 0, "max_length must be a positive integer, got 0"),
        ("max_length", -3, "max_length must be a positive integer, got -3"),
        ("max_length", "abc", "max_length must be a positive integer, got 'abc'"),
        ("max_length", 2.5, "max_length must be a positive integer, got 2.5"),
        ("max_gen_toks", "x", "max_gen_toks must be an integer of at least 0, got 'x'"),
        ("max_gen_toks", -1, "max_gen_toks must be an integer of at least 0, got -1"),
    ],
)
def test_bad_numeric_model_args_are_one_clear_refusal(harness, option, value, message):
    BDHLM = harness.backend.BDHLM
    with pytest.raises(ConfigError, match=f"^{message}$"):
        BDHLM.create_from_arg_obj(
            {"model": tiny_model(vocab_size=256), "tokenizer": ByteTokenizer(), option: value}
        )


def test_a_task_whose_every_document_is_empty_is_refused(harness, model64):
    """lm-eval divides a rolling task's log-likelihood by its bytes or words: a task of
    empty documents only is refused by name; an empty document beside others scores 0."""
    lm = harness.backend.BDHLM(
        model=model64, tokenizer=ByteTokenizer(), rolling="windows", max_length=8
    )
    empty = [SimpleNamespace(args=("",), task_name="blank") for _ in range(2)]
    with pytest.raises(BDHTrainError, match="^every document of task 'blank' is empty: "):
        lm.loglikelihood_rolling(empty)
    mixed = [SimpleNamespace(args=(text,), task_name="mixed") for text in ("", "ab")]
    assert lm.loglikelihood_rolling(mixed)[0] == 0.0
    with pytest.raises(ConfigError, match="^the task's max_gen_toks must be an integer of at"):
        lm.generate_until([SimpleNamespace(args=("a", {"max_gen_toks": "many"}))])
    with pytest.raises(ConfigError, match="^the task's temperature must be a number of at l"):
        lm.generate_until([SimpleNamespace(args=("a", {"do_sample": True, "temperature": "hot"}))])
