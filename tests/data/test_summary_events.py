"""Summary events from data: the trigger mask against a plain loop, every loader emits it,
loader state and resume are unchanged, and the config rules that tie it to the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bdh_train.config import RunConfig
from bdh_train.data import DataConfig, RandomWindowLoader, StreamingDocumentLoader, eval_batches
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.errors import ConfigError
from bdh_train.model import BDHConfig
from bdh_train.model.config import SummaryMemoryConfig
from bdh_train.model.summary import NO_TOKEN

# a small alphabet so the trigger occurs often, also across window boundaries
STREAM = np.random.default_rng(0).integers(0, 4, 2000).astype(np.int64)
TRIGGER = SummaryEventTrigger(sequence=(1, 2, 1), ids=(3,))


def loop_mask(row: list[int], trigger: SummaryEventTrigger, before: list[int] = ()) -> list[int]:
    """The slow twin: for each input t, do the k tokens ending at t (within before + row)
    equal the sequence, or is the token one of the ids?"""
    seq, k, out = list(trigger.sequence), len(trigger.sequence), []
    full = list(before) + list(row)
    for t in range(len(row)):
        end = len(before) + t + 1
        hit = row[t] in trigger.ids or (k > 0 and end >= k and full[end - k : end] == seq)
        out.append(int(hit))
    return out


def test_trigger_mask_equals_the_loop() -> None:
    inputs = torch.from_numpy(STREAM[:120].reshape(4, 30))
    got = TRIGGER.mask(inputs)
    assert got.dtype == torch.bool
    assert got.long().tolist() == [loop_mask(r, TRIGGER) for r in inputs.tolist()]
    assert got.any() and not got.all()
    history = torch.tensor([[NO_TOKEN, 1], [1, 2], [2, 1], [NO_TOKEN, NO_TOKEN]])
    rows = [
        [1] if h[0] == NO_TOKEN and h[1] != NO_TOKEN else [x for x in h if x != NO_TOKEN]
        for h in history.tolist()
    ]
    with_history = TRIGGER.mask(inputs, history)
    for r, before in enumerate(rows):
        assert with_history[r].long().tolist() == loop_mask(inputs[r].tolist(), TRIGGER, before)
    only_ids = SummaryEventTrigger(ids=(0, 2))
    assert torch.equal(only_ids.mask(inputs), (inputs == 0) | (inputs == 2))


def test_random_windows_carry_their_mask_and_the_same_state() -> None:
    plain = RandomWindowLoader(STREAM, 16, 4, seed=3, accumulation_steps=2)
    marked = RandomWindowLoader(
        STREAM, 16, 4, seed=3, accumulation_steps=2, summary_trigger=TRIGGER
    )
    for _ in range(3):
        a, b = plain.next_batch(), marked.next_batch()
        assert a.summary_event_mask is None
        assert torch.equal(a.inputs, b.inputs)
        assert b.summary_event_mask.long().tolist() == [
            loop_mask(r, TRIGGER) for r in b.inputs.tolist()
        ]
    assert plain.state_dict() == marked.state_dict()  # nothing new in the loader state
    resumed = RandomWindowLoader(
        STREAM, 16, 4, seed=3, accumulation_steps=2, summary_trigger=TRIGGER
    )
    resumed.load_state_dict(marked.state_dict())
    nxt, again = marked.next_batch(), resumed.next_batch()
    assert torch.equal(nxt.summary_event_mask, again.summary_event_mask)


def test_streamed_documents_get_the_mask_of_the_whole_document() -> None:
    """Windows of 4 tokens, a 3-token trigger: events that span windows of one document are
    found (history), none reaches back across a document's start."""
    block, length = 4, 24
    stream = STREAM.copy()
    for start in range(length, len(stream) - 1, length):  # a trigger across every doc start
        stream[start - 2 : start + 1] = TRIGGER.sequence
    marked = StreamingDocumentLoader(stream, block, 2, length, seed=1, summary_trigger=TRIGGER)
    plain = StreamingDocumentLoader(stream, block, 2, length, seed=1)
    rows: list[list[int]] = [[], []]
    masks: list[list[int]] = [[], []]
    spans = 0
    for _ in range(length // block * 3):  # three documents per row
        b = marked.next_batch()
        assert torch.equal(plain.next_batch().inputs, b.inputs)
        for r in range(2):
            if b.reset[r]:
                rows[r], masks[r] = [], []
            rows[r] += b.inputs[r].tolist()
            masks[r] += b.summary_event_mask[r].long().tolist()
            assert masks[r] == loop_mask(rows[r], TRIGGER)  # the document so far, at once
            per_window = loop_mask(b.inputs[r].tolist(), TRIGGER)
            spans += sum(masks[r][-block:]) - sum(per_window)
    assert spans > 0  # some events did span two windows
    assert marked.state_dict() == plain.state_dict()  # nothing new in the loader state
    resumed = StreamingDocumentLoader(stream, block, 2, length, seed=1, summary_trigger=TRIGGER)
    resumed.load_state_dict(marked.state_dict())
    assert torch.equal(
        marked.next_batch().summary_event_mask, resumed.next_batch().summary_event_mask
    )


def test_eval_batches_carry_per_window_masks() -> None:
    batches = list(eval_batches(STREAM[:101], 10, 4, summary_trigger=TRIGGER))
    for b in batches:
        assert b.summary_event_mask.long().tolist() == [
            loop_mask(r, TRIGGER) for r in b.inputs.tolist()
        ]
    assert all(b.summary_event_mask is None for b in eval_batches(STREAM[:101], 10, 4))


# ------------------------------------------------------------------ config
def test_data_trigger_config() -> None:
    cfg = DataConfig(summary_write_trigger_text="é!", summary_write_trigger_token_ids=[7])
    assert cfg.validate().summary_trigger() == SummaryEventTrigger((0xC3, 0xA9, 0x21), (7,))
    assert DataConfig().summary_trigger() is None
    for fields, message in [
        ({"summary_write_trigger_text": ""}, "data.summary_write_trigger_text must be a non-empty"),
        ({"summary_write_trigger_token_ids": []}, "data.summary_write_trigger_token_ids must be"),
        (
            {"summary_write_trigger_token_ids": [1, -2]},
            r"data.summary_write_trigger_token_ids\[\] must be a non-negative integer",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            DataConfig(**fields).validate()


def _run(text=None, ids=None, vocab=256, **summary) -> RunConfig:
    return RunConfig(
        model=BDHConfig(vocab_size=vocab, summary_memory=SummaryMemoryConfig(**summary)),
        data=DataConfig(summary_write_trigger_text=text, summary_write_trigger_token_ids=ids),
    )


def test_trigger_and_write_gate_go_together() -> None:
    _run("##", enabled=True, write_gate=True).validate()
    _run(ids=[5], enabled=True, write_gate=True).validate()
    with pytest.raises(
        ConfigError,
        match="set model.summary_memory.enabled=true and model.summary_memory.write_gate=true",
    ):
        _run("##").validate()
    with pytest.raises(ConfigError, match="write_gate=true writes only at summary events"):
        _run(enabled=True, write_gate=True).validate()
    with pytest.raises(
        ConfigError,
        match=r"trigger_token_ids holds token id 40, outside "
        r"model.vocab_size \(32\)",
    ):
        _run(ids=[3, 40], vocab=32, enabled=True, write_gate=True).validate()
    with pytest.raises(ConfigError, match=r"trigger_text holds token id 122"):
        _run("z", vocab=100, enabled=True, write_gate=True).validate()


def test_notes_name_calls_that_do_not_align_with_summary_chunks() -> None:
    cfg = RunConfig.from_dict(
        {
            "model": {"summary_memory": {"enabled": True, "chunk_tokens": 32}},
            "training": {
                "block_size": 100,
                "tbptt_chunk_size": 48,
                "tbptt_persist_across_steps": True,
            },
        }
    )
    notes = cfg.notes()
    assert len(notes) == 2
    assert "training.tbptt_chunk_size (48) is not a multiple of " in notes[0]
    assert "model.summary_memory.chunk_tokens (32)" in notes[0]
    assert "training.block_size (100)" in notes[1]
    cfg.training.tbptt_chunk_size, cfg.training.block_size = 64, 128
    assert cfg.notes() == []
    cfg.training.tbptt_chunk_size = 48
    cfg.model.summary_memory.enabled = False
    assert cfg.notes() == []
