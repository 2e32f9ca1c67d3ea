"""Loaders: determinism, resume, rank slicing, streaming semantics, eval windows.

Token streams are np.arange(N) so every token is its own position and windows can be checked
arithmetically.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bdh_train.batch import IGNORE_INDEX, SequenceBatch
from bdh_train.data import (
    RandomWindowLoader,
    StreamingCorpusLoader,
    StreamingDocumentLoader,
    TokenData,
    eval_batches,
    load_tokens,
    write_token_file,
)
from bdh_train.data.loaders import MixedWindowLoader, document_starts
from bdh_train.errors import ConfigError, DataError

TOKENS = np.arange(5000, dtype=np.int64)


def _same(a: SequenceBatch, b: SequenceBatch) -> bool:
    same_reset = (a.reset is None and b.reset is None) or (
        a.reset is not None and b.reset is not None and torch.equal(a.reset, b.reset)
    )
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) and same_reset


def _cat(batches: list[SequenceBatch]) -> SequenceBatch:
    resets = [b.reset for b in batches]
    return SequenceBatch(
        torch.cat([b.inputs for b in batches]),
        torch.cat([b.targets for b in batches]),
        None if resets[0] is None else torch.cat(resets),  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- random windows


def test_random_windows_are_shifted_slices() -> None:
    loader = RandomWindowLoader(TOKENS, block_size=16, batch_size=8, seed=0)
    batch = loader.next_batch()
    assert batch.inputs.shape == (8, 16) and batch.inputs.dtype == torch.long
    assert batch.reset is None
    starts = batch.inputs[:, 0]
    assert torch.equal(batch.inputs, starts[:, None] + torch.arange(16))
    assert torch.equal(batch.targets, batch.inputs + 1)
    assert int(starts.max()) <= len(TOKENS) - 17


def test_random_is_pure_function_of_seed_step_micro() -> None:
    a = RandomWindowLoader(TOKENS, 8, 4, seed=7, accumulation_steps=3)
    b = RandomWindowLoader(TOKENS, 8, 4, seed=7, accumulation_steps=3)
    calls = [a.next_batch() for _ in range(7)]
    for i, batch in enumerate(calls):
        assert _same(batch, b.batch_at(i // 3, i % 3))
    assert (a.step, a.micro) == (2, 1)
    assert not _same(calls[0], calls[1])
    other = RandomWindowLoader(TOKENS, 8, 4, seed=8)
    assert not _same(calls[0], other.batch_at(0, 0))


def test_random_resume_continues_identically() -> None:
    ref = RandomWindowLoader(TOKENS, 8, 4, seed=3, accumulation_steps=2)
    for _ in range(5):
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))  # must survive plain serialization
    resumed = RandomWindowLoader(TOKENS, 8, 4, seed=3, accumulation_steps=2)
    resumed.load_state_dict(state)
    for _ in range(6):
        assert _same(ref.next_batch(), resumed.next_batch())


def test_random_rank_slices_concatenate_to_global_batch() -> None:
    full = RandomWindowLoader(TOKENS, 8, 6, seed=11)
    ranks = [RandomWindowLoader(TOKENS, 8, 6, seed=11, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        parts = [r.next_batch() for r in ranks]
        assert parts[0].batch_size == 3
        assert _same(_cat(parts), full.next_batch())


def test_random_errors() -> None:
    with pytest.raises(ConfigError, match=r"batch_size 6 is not divisible by world_size 4"):
        RandomWindowLoader(TOKENS, 8, 6, seed=0, world_size=4)
    with pytest.raises(ConfigError, match=r"rank must be in \[0, world_size=2\), got 2"):
        RandomWindowLoader(TOKENS, 8, 6, seed=0, rank=2, world_size=2)
    with pytest.raises(DataError, match=r"has 8 tokens, fewer than block_size \+ 1 = 9"):
        RandomWindowLoader(np.arange(8), 8, 2, seed=0)
    loader = RandomWindowLoader(TOKENS, 8, 4, seed=0)
    changed = r"settings or data changed.*seed: saved 0, now 1\); resume with the original"
    with pytest.raises(DataError, match=changed):
        RandomWindowLoader(TOKENS, 8, 4, seed=1).load_state_dict(loader.state_dict())
    other = r"num_starts: saved \d+, now 42\): data.source names other text .*checkpoint.init_from"
    with pytest.raises(DataError, match=other):
        RandomWindowLoader(TOKENS[:50], 8, 4, seed=0).load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match=r"block_size: saved 8, now 16.*\); resume with the"):
        RandomWindowLoader(TOKENS, 16, 4, seed=0).load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match=r"loader state is for 'streaming_document'"):
        loader.load_state_dict({"kind": "streaming_document"})


def test_set_accumulation_steps() -> None:
    loader = RandomWindowLoader(TOKENS, 8, 4, seed=0, accumulation_steps=2)
    loader.next_batch()
    with pytest.raises(ConfigError, match=r"change it at a step boundary"):
        loader.set_accumulation_steps(1)
    loader.next_batch()
    loader.set_accumulation_steps(4)
    for m in range(4):
        assert _same(loader.next_batch(), loader.batch_at(1, m))
    assert (loader.step, loader.micro) == (2, 0)


def test_random_over_memmapped_bin(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "t.bin", np.arange(3000) % 1000, vocab_size=1000)
    data = load_tokens(str(path), vocab_size=1000)
    batch = RandomWindowLoader(data, 16, 4, seed=0).next_batch()
    assert torch.equal(batch.targets % 1000, (batch.inputs + 1) % 1000)


# ---------------------------------------------------------------- streaming documents

T, L, B = 4, 12, 4  # 3 windows per document
STREAM = np.arange(7 * L + 1 + 3, dtype=np.int64)  # 7 documents plus a short tail


def test_streaming_windows_resets_and_contiguity() -> None:
    loader = StreamingDocumentLoader(STREAM, T, B, logical_length=L, seed=5)
    assert loader.num_docs == 7 and loader.windows_per_doc == 3
    prev: SequenceBatch | None = None
    started: list[int] = []
    for _ in range(3 * 5):  # five documents per row: crosses two epoch boundaries
        batch = loader.next_batch()
        assert batch.reset is not None and batch.inputs.shape == (B, T)
        assert torch.equal(batch.targets, batch.inputs + 1)
        assert torch.equal(batch.inputs, batch.inputs[:, :1] + torch.arange(T))
        starts = batch.inputs[:, 0]
        at_doc_start = starts % L == 0
        assert torch.equal(batch.reset, at_doc_start)
        for b in range(B):
            if batch.reset[b]:
                started.append(int(starts[b]) // L)
            else:
                assert prev is not None and prev.reset is not None
                # window k+1 starts where window k's last target is
                assert int(starts[b]) == int(prev.targets[b, -1])
        prev = batch
    # documents are handed out in row order from the per-epoch permutations
    assert started[:7] == loader.epoch_order(0).tolist()
    assert started[7:14] == loader.epoch_order(1).tolist()
    assert loader.epoch_order(0).tolist() != loader.epoch_order(1).tolist()
    assert sorted(started[:7]) == list(range(7))


def test_streaming_is_seeded() -> None:
    a = StreamingDocumentLoader(STREAM, T, B, L, seed=1)
    b = StreamingDocumentLoader(STREAM, T, B, L, seed=1)
    c = StreamingDocumentLoader(STREAM, T, B, L, seed=2)
    a_batches = [a.next_batch() for _ in range(6)]
    assert all(_same(x, b.next_batch()) for x in a_batches)
    assert not all(_same(x, c.next_batch()) for x in a_batches)


@pytest.mark.parametrize("stop", [1, 3, 7, 10])
def test_streaming_resume_continues_identically(stop: int) -> None:
    ref = StreamingDocumentLoader(STREAM, T, B, L, seed=9)
    for _ in range(stop):
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))
    assert state["rows"] == [[d, w] for d, w in zip(ref.row_doc, ref.row_next, strict=True)]
    resumed = StreamingDocumentLoader(STREAM, T, B, L, seed=9)
    resumed.load_state_dict(state)
    for _ in range(12):
        assert _same(ref.next_batch(), resumed.next_batch())


def test_streaming_rank_slices_concatenate_to_global_batch() -> None:
    full = StreamingDocumentLoader(STREAM, T, B, L, seed=4)
    ranks = [StreamingDocumentLoader(STREAM, T, B, L, seed=4, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(8):
        assert _same(_cat([r.next_batch() for r in ranks]), full.next_batch())
    # a rank's state resumes the global cursor, so world_size may change across a resume
    one = StreamingDocumentLoader(STREAM, T, B, L, seed=4)
    one.load_state_dict(ranks[1].state_dict())
    assert _same(one.next_batch(), full.next_batch())


def test_streaming_errors() -> None:
    # documents are whole blocks: a length of 10 with blocks of 4 is rounded up to 12
    assert StreamingDocumentLoader(STREAM, 4, 2, logical_length=10, seed=0).logical_length == 12
    with pytest.raises(DataError, match=r"has 12 tokens, fewer than logical_length \+ 1 = 13"):
        StreamingDocumentLoader(np.arange(12), 4, 2, logical_length=12, seed=0)
    with pytest.raises(ConfigError, match=r"batch_size 3 is not divisible by world_size 2"):
        StreamingDocumentLoader(STREAM, 4, 3, 12, seed=0, world_size=2)
    loader = StreamingDocumentLoader(STREAM, T, B, L, seed=0)
    other = StreamingDocumentLoader(STREAM, T, B, 2 * L, seed=0)
    with pytest.raises(DataError, match=r"logical_length: saved 24, now 12"):
        loader.load_state_dict(other.state_dict())


# ---------------------------------------------------------------- evaluation


def test_eval_batches_cover_tokens_once() -> None:
    val = TokenData(np.arange(23), 256, "val")
    batches = list(eval_batches(val, block_size=4, batch_size=2))
    assert [b.batch_size for b in batches] == [2, 2, 1]  # 5 windows, smaller last batch
    assert torch.equal(torch.cat([b.inputs for b in batches]).flatten(), torch.arange(20))
    assert torch.equal(torch.cat([b.targets for b in batches]).flatten(), torch.arange(1, 21))
    again = list(eval_batches(val, 4, 2))
    assert all(_same(x, y) for x, y in zip(batches, again, strict=True))
    assert len(list(eval_batches(val, 4, 2, max_batches=2))) == 2
    assert [b.batch_size for b in eval_batches(val, 4, 64)] == [5]


def test_eval_batches_too_short() -> None:
    with pytest.raises(
        DataError,
        match=r"validation data from .* has 4 tokens, fewer than "
        r"block_size \+ 1 = 5",
    ):
        eval_batches(np.arange(4), 4, 2)  # raises at the call, not at first next()


def test_random_windows_reach_every_start_offset_including_the_last() -> None:
    """12 tokens, block 4: a window needs 5 tokens, so the valid starts are exactly 0..7 and
    the last window [7, 12) ends on the last token. 50 steps of 4 rows = 200 draws over 8
    starts: with a uniform draw every start shows up (a given start is missed with
    probability (7/8)^200 < 1e-11), and the seed makes the run fixed anyway."""
    tokens = np.arange(12, dtype=np.int64)
    loader = RandomWindowLoader(tokens, block_size=4, batch_size=4, seed=5)
    starts: set[int] = set()
    for _ in range(50):
        batch = loader.next_batch()
        assert torch.equal(batch.inputs, batch.inputs[:, :1] + torch.arange(4))
        assert torch.equal(batch.targets, batch.inputs + 1)
        starts.update(batch.inputs[:, 0].tolist())
    assert starts == set(range(8)), f"never drawn: {sorted(set(range(8)) - starts)}"


def test_random_windows_with_a_single_valid_start() -> None:
    """block_size + 1 tokens exactly: the only window is the whole stream."""
    loader = RandomWindowLoader(np.arange(5, dtype=np.int64), block_size=4, batch_size=3, seed=0)
    for _ in range(3):
        batch = loader.next_batch()
        assert batch.inputs.tolist() == [[0, 1, 2, 3]] * 3
        assert batch.targets.tolist() == [[1, 2, 3, 4]] * 3


# ------------------------------------------------------------------ mixed windows
def test_mixed_windows_take_row_r_from_source_r_mod_the_sources() -> None:
    """Sources 0..11 and 100..111, block 4 (starts 0..7 of each), batch 5: rows 0, 2 and 4
    are shifted slices of the first source, rows 1 and 3 of the second. 40 batches of 5 rows
    draw each source's 8 starts 100 and 80 times: a given start is missed with probability
    (7/8)^80 < 3e-5 (and the seed fixes the draw). Batch n is a function of (seed, n) alone."""
    sources = [np.arange(12, dtype=np.int64), np.arange(100, 112, dtype=np.int64)]
    loader = MixedWindowLoader(sources, block_size=4, batch_size=5, seed=3)
    starts: list[set[int]] = [set(), set()]
    batches = [loader.next_batch() for _ in range(40)]
    for batch in batches:
        assert batch.inputs.shape == (5, 4) and batch.reset is None
        assert torch.equal(batch.inputs, batch.inputs[:, :1] + torch.arange(4))
        assert torch.equal(batch.targets, batch.inputs + 1)
        for row, first in enumerate(batch.inputs[:, 0].tolist()):
            starts[row % 2].add(first)
    assert starts == [set(range(8)), set(range(100, 108))]
    again = MixedWindowLoader(sources, block_size=4, batch_size=5, seed=3)
    assert all(_same(again.batch_at(n), batches[n]) for n in (0, 17, 39))
    other = MixedWindowLoader(sources, block_size=4, batch_size=5, seed=4)
    assert not all(_same(other.batch_at(n), batches[n]) for n in range(3))
    with pytest.raises(DataError, match=r"has 4 tokens, fewer than block_size \+ 1 = 5"):
        MixedWindowLoader([sources[0], np.arange(4)], block_size=4, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="at least one token source"):
        MixedWindowLoader([], block_size=4, batch_size=2, seed=0)


# ------------------------------------------------------------------ corpus documents
IGN = IGNORE_INDEX


def _identity_order(monkeypatch) -> None:
    monkeypatch.setattr(
        StreamingCorpusLoader, "epoch_order", lambda self, epoch: np.arange(self.num_docs)
    )


def test_corpus_loader_deals_documents_as_written_out_by_hand(monkeypatch) -> None:
    """Documents A=[0,1,2], B=[3], C=[4..8], D=[9,10,11] in their own order, T=4, two rows.
    Row 0 takes A, B and C's first token; row 1 takes D, then (epoch 1) A. A document's first
    input is a reset, a target that is a document's first token is ignored, and a window's
    last token is the next window's first."""
    _identity_order(monkeypatch)
    data = TokenData(np.arange(12), 12, "docs", doc_starts=np.array([0, 3, 4, 9]))
    loader = StreamingCorpusLoader(data, 4, 2, seed=0)
    first, second = loader.next_batch(), loader.next_batch()
    assert first.inputs.tolist() == [[0, 1, 2, 3], [9, 10, 11, 0]]
    assert first.targets.tolist() == [[1, 2, IGN, IGN], [10, 11, IGN, 1]]
    assert first.reset.tolist() == [[True, False, False, True], [True, False, False, True]]
    assert second.inputs.tolist() == [[4, 5, 6, 7], [1, 2, 3, 4]]
    assert second.targets.tolist() == [[5, 6, 7, 8], [2, IGN, IGN, 5]]
    assert second.reset.tolist() == [[True, False, False, False], [False, False, True, True]]
    assert loader.state_dict()["rows"] == [[2, 4], [2, 1]]  # (C, token 8), (C, token 5)
    assert (loader.epoch, loader.position) == (1, 3)


def test_corpus_documents_from_end_of_document_tokens(monkeypatch) -> None:
    """Without doc_starts, a document ends at each end-of-document id (7 here): the same
    dealing as the explicit starts after every 7."""
    _identity_order(monkeypatch)
    tokens = np.array([1, 2, 7, 3, 7, 4, 5, 6, 7, 1, 2])
    by_eot = StreamingCorpusLoader(TokenData(tokens, 8, "eot", eot_id=7), 3, 1, seed=0)
    by_starts = StreamingCorpusLoader(
        TokenData(tokens, 8, "starts", doc_starts=np.array([0, 3, 5, 9])), 3, 1, seed=0
    )
    assert by_eot.doc_bounds.tolist() == [0, 3, 5, 9, 11]
    for _ in range(5):
        assert _same(by_eot.next_batch(), by_starts.next_batch())
    with pytest.raises(DataError, match="no document index"):
        StreamingCorpusLoader(TokenData(tokens, 8, "plain"), 3, 1, seed=0)


def _corpus() -> TokenData:
    starts = np.array([0, 5, 6, 30, 31, 32, 70, 90, 140, 141, 170])
    return TokenData(np.arange(200), 200, "corpus", doc_starts=starts)


@pytest.mark.parametrize("stop", [1, 3])
def test_corpus_resume_and_rank_slices(stop: int) -> None:
    """A loader restored from its state_dict (through JSON) continues identically, and the
    ranks' rows concatenate to the global batch."""
    ref = StreamingCorpusLoader(_corpus(), 8, 4, seed=3)
    expected = [ref.next_batch() for _ in range(12)]
    first = StreamingCorpusLoader(_corpus(), 8, 4, seed=3)
    for _ in range(stop):
        first.next_batch()
    resumed = StreamingCorpusLoader(_corpus(), 8, 4, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert all(_same(resumed.next_batch(), e) for e in expected[stop:])
    ranks = [StreamingCorpusLoader(_corpus(), 8, 4, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for e in expected[:3]:
        assert _same(_cat([r.next_batch() for r in ranks]), e)


def test_corpus_loader_refuses_bad_state_and_settings() -> None:
    loader = StreamingCorpusLoader(_corpus(), 8, 2, seed=0)
    state = loader.state_dict()
    with pytest.raises(DataError, match="inconsistent"):
        loader.load_state_dict({**state, "rows": [[1, 1], [0, 0]]})  # document 1 has 1 token
    with pytest.raises(DataError, match="seed: saved 0, now 1"):
        StreamingCorpusLoader(_corpus(), 8, 2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="summary memory"):
        StreamingCorpusLoader(_corpus(), 8, 2, seed=0, summary_trigger=object())
    documents = len(document_starts(_corpus()))
    with pytest.raises(DataError, match=f"has {documents} document.*fewer than the batch's"):
        StreamingCorpusLoader(_corpus(), 8, documents + 1, seed=0)
