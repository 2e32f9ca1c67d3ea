"""A prompt is read in chunks (`read_tokens`): the chunks equal one call, and the memory of
reading it does not grow with its length, whichever entry point reads it."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from bdh_train.data.events import SummaryEventTrigger
from bdh_train.generation.continuation import Continuation
from bdh_train.inspect.synapses import read_state
from bdh_train.model import sampling
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.sampling import PREFILL_TOKENS, read_tokens
from bdh_train.model.state import ModelState

GATED = SummaryMemoryConfig(enabled=True, chunk_tokens=4, write_gate=True, residual_scale=1.0)
TRIGGER = SummaryEventTrigger(sequence=(2, 3, 0))


def _model(position: str, summary: bool):
    overrides = {"summary_memory": GATED, "vocab_size": 4} if summary else {}
    model = tiny_model(position=position, **overrides).eval()
    if position == "alibi_learned":
        with torch.no_grad():
            model.decay_log_gain.copy_(torch.tensor([0.7, -0.9]))
    return model


def _read(model, ids, events, chunk_tokens):
    state = model.init_state(ids.shape[0])
    with torch.inference_mode():
        hidden, recent = read_tokens(model, state, ids, events, chunk_tokens=chunk_tokens)
        logits = model.logits_from_hidden(hidden)
    return state, logits, recent


def _assert_states_close(a: ModelState, b: ModelState, rtol: float) -> None:
    assert torch.equal(a.position, b.position)
    assert [r is None for r in a.rho] == [r is None for r in b.rho]
    assert_close(
        {f"rho{i}": r for i, r in enumerate(a.rho) if r is not None},
        {f"rho{i}": r for i, r in enumerate(b.rho) if r is not None},
        rtol=rtol,
    )
    for got, expected in zip(a.summary, b.summary, strict=True):
        assert (got is None) == (expected is None)
        if got is not None and expected is not None:
            assert torch.equal(got.chunk_hits, expected.chunk_hits)
            assert_close(got.memory, expected.memory, rtol=rtol, atol=1e-7)
            assert_close(got.chunk_sum, expected.chunk_sum, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("summary", [False, True], ids=["plain", "gated_summary_memory"])
@pytest.mark.parametrize("position", ["rope", "alibi", "alibi_learned"])
@pytest.mark.parametrize("length, chunk", [(23, 5), (23, 4), (9, 1), (17, 16), (30, 7)])
def test_reading_in_chunks_equals_one_call(position, summary, length, chunk):
    """State and next-token logits after the chunks equal those after one call (float32,
    norm-relative 1e-5, the tolerance of test_model_state's split calls), for lengths that
    are no multiple of the chunk."""
    model = _model(position, summary)
    events = TRIGGER if summary else None
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(length))
    whole_state, whole_logits, whole_recent = _read(model, ids, events, None)
    state, logits, recent = _read(model, ids, events, chunk)
    _assert_states_close(state, whole_state, rtol=1e-5)
    assert_close(logits, whole_logits, rtol=1e-5)
    if summary:
        assert recent is not None and whole_recent is not None
        assert torch.equal(recent, whole_recent)
        assert torch.equal(recent, ids[:, -TRIGGER.history_len :])


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_a_prompt_of_one_chunk_is_read_as_one_call_bit_for_bit(position):
    """Up to PREFILL_TOKENS the same operations run as in one call: the same bits."""
    model = _model(position, False)
    ids = torch.randint(0, 32, (1, 40), generator=torch.Generator().manual_seed(1))
    whole_state, whole_logits, _ = _read(model, ids, None, None)
    state, logits, _ = _read(model, ids, None, 40)
    assert torch.equal(logits, whole_logits)
    assert all(torch.equal(a, b) for a, b in zip(state.rho, whole_state.rho, strict=True))


def test_a_prompt_read_after_a_state_continues_it():
    """Chunks on top of a carried state (a continuation's second feed): the recent tokens
    carry the summary events across the boundary (the trigger 2, 3, 0 spans it)."""
    model = _model("rope", True)
    first, second = torch.tensor([[1, 2]]), torch.tensor([[3, 0, 1, 2, 3, 0, 3]])
    whole_state, whole_logits, _ = _read(model, torch.cat([first, second], 1), TRIGGER, None)
    state = model.init_state(1)
    with torch.inference_mode():
        _, recent = read_tokens(model, state, first, TRIGGER, chunk_tokens=None)
        hidden, _ = read_tokens(model, state, second, TRIGGER, recent, chunk_tokens=3)
        logits = model.logits_from_hidden(hidden)
    _assert_states_close(state, whole_state, rtol=1e-5)
    assert_close(logits, whole_logits, rtol=1e-5)


def test_chunk_tokens_must_be_positive_and_a_prompt_nonempty():
    model = _model("rope", False)
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        read_tokens(model, model.init_state(1), torch.tensor([[1]]), chunk_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        read_tokens(model, model.init_state(1), torch.zeros(1, 0, dtype=torch.long))


# ------------------------------------------------------------------ memory
class LargestActivation(TorchDispatchMode):
    """Records the largest floating tensor any operation returns (activations; token ids,
    which the caller holds anyway, are integers), and fails the first operation whose output
    exceeds `limit` bytes, before a runaway read fills the machine."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit, self.largest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                size = t.numel() * t.element_size()
                self.largest = max(self.largest, size)
                if self.limit is not None and size > self.limit:
                    raise AssertionError(
                        f"{func} returned {size} bytes, more than the {self.limit} reading "
                        "a tenth of the prompt took"
                    )
        return out


def _feed(model, ids):
    Continuation(model).feed(ids)


def _stream(model, ids):
    list(sampling.stream_generate(model, ids, 1, temperature=0))


def _generate_batch(model, ids):
    sampling.generate_batch(model, [ids, ids[:5]], 1, temperature=0)


def _inspect_prompt(model, ids):
    read_state(model, ids.tolist(), 0)


@pytest.mark.parametrize(
    "read", [_feed, _stream, _generate_batch, _inspect_prompt], ids=lambda f: f.__name__[1:]
)
def test_reading_a_long_prompt_takes_the_memory_of_a_short_one(read):
    """The largest activation while reading 20 chunks of tokens is no larger than while
    reading 2: 1 MiB either way (one call over the whole prompt: 2 MiB and 20 MiB).
    `generate` reads through `stream_generate`, `inspect --prompt(s)` through `read_state`."""
    model = tiny_model().eval()
    short, long = (torch.randint(0, 32, (n * PREFILL_TOKENS,)) for n in (2, 20))
    with LargestActivation() as probe:
        read(model, short)
    with LargestActivation(limit=probe.largest) as bounded:
        read(model, long)
    assert bounded.largest <= probe.largest
