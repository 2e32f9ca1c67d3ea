"""Batch loaders over a flat token stream.

The training loaders are deterministic functions of their seed and a small cursor, and expose
that cursor through `state_dict()` / `load_state_dict()`, so a resumed run draws exactly the
batches the uninterrupted run would have drawn. Both work on the GLOBAL batch (all ranks'
rows) and hand each rank its contiguous slice of rows; world_size can therefore change
between save and resume without changing what any global row sees. The streaming loaders
deal documents to rows: fixed-length slices of the stream (`StreamingDocumentLoader`) or the
corpus's own documents (`StreamingCorpusLoader`, from `TokenData.doc_starts` or its end-of-
document tokens). Given a summary write
trigger, every loader also emits the batch's summary event mask, a function of the tokens
(`events.py`), so the cursor stays all the state there is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from bdh_train import checks
from bdh_train.batch import IGNORE_INDEX, SequenceBatch
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.tokens import TokenData
from bdh_train.errors import ConfigError, DataError
from bdh_train.model.summary import NO_TOKEN

TokenSource = TokenData | np.ndarray | torch.Tensor
"""What the loaders accept: a TokenData, a 1-D integer numpy array/memmap or tensor."""

_U64 = (1 << 64) - 1
_STREAM_PERM_TAG = 0x5D0C
"""Mixed into the epoch-permutation seed so it never coincides with a random-window seed."""
_SCAN_CHUNK = 1 << 22
"""Tokens scanned per chunk for end-of-document ids, so a memmap is never read whole."""
_MIX_TAG = 0x313C
"""Mixed into the mixed loader's seed so it never coincides with a random-window seed."""


def as_tokens(tokens: TokenSource) -> tuple[np.ndarray, str]:
    if isinstance(tokens, TokenData):
        return tokens.tokens, tokens.source
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(
            f"loaders need a 1-D integer token array, got shape {arr.shape} dtype {arr.dtype}"
        )
    return arr, "the token array"


def logical_length_for(requested: int, block_size: int) -> int:
    """The logical length streamed documents get: they are cut into whole blocks, so a
    requested length is rounded UP to a multiple of the block (0 stands for one block)."""
    return max(1, -(-requested // block_size)) * block_size


def _check_ranks(batch_size: int, rank: int, world_size: int) -> None:
    checks.positive_int("world_size", world_size)
    checks.integer("rank", rank)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if batch_size % world_size:
        fits = [n for n in range(1, batch_size + 1) if batch_size % n == 0]
        raise ConfigError(
            f"batch_size {batch_size} is not divisible by world_size {world_size}: the global "
            f"batch is split into equal per-rank slices; run {', '.join(map(str, fits))} "
            f"processes, or pick a batch_size that is a multiple of {world_size}"
        )


def _seed_from(*words: int) -> int:
    """A 64-bit torch seed that depends on every word (SeedSequence hashing, so (1, 23) and
    (12, 3) never collide the way `a * k + b` formulas can)."""
    state = np.random.SeedSequence([w & _U64 for w in words]).generate_state(2, np.uint64)
    return int(state[0]) ^ (int(state[1]) >> 1)


def gather_windows(tokens: np.ndarray, starts: list[int] | np.ndarray, width: int) -> torch.Tensor:
    """[len(starts), width] int64 tensor of tokens[s : s + width] (copied out of the memmap)."""
    if len(starts) == 0:
        return torch.empty((0, width), dtype=torch.long)
    rows = np.stack([np.asarray(tokens[int(s) : int(s) + width]) for s in starts])
    return torch.from_numpy(rows.astype(np.int64))


def windows_to_batch(
    windows: torch.Tensor,
    reset: torch.Tensor | None,
    trigger: SummaryEventTrigger | None = None,
    history: torch.Tensor | None = None,
) -> SequenceBatch:
    inputs = windows[:, :-1].contiguous()
    mask = None if trigger is None else trigger.mask(inputs, history)
    return SequenceBatch(inputs, windows[:, 1:].contiguous(), reset, mask)


class _RankedLoader:
    """What both loaders share: the token array, the global batch shape, the seed, and which
    rows of each global batch this rank takes."""

    def __init__(
        self,
        tokens: TokenSource,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        summary_trigger: SummaryEventTrigger | None = None,
    ) -> None:
        self.summary_trigger = summary_trigger
        self.tokens, self.source = as_tokens(tokens)
        self.block_size = checks.positive_int("block_size", block_size)
        self.batch_size = checks.positive_int("batch_size", batch_size)
        _check_ranks(self.batch_size, rank, world_size)
        self.seed = checks.integer("seed", seed)
        self.rank = int(rank)
        self.world_size = int(world_size)

    @property
    def rows_per_rank(self) -> int:
        return self.batch_size // self.world_size

    def next_batch(self) -> SequenceBatch:
        raise NotImplementedError

    def __iter__(self) -> Iterator[SequenceBatch]:
        while True:
            yield self.next_batch()


class RandomWindowLoader(_RankedLoader):
    """Windows of block_size + 1 tokens at uniformly random positions.

    The global batch of micro-batch `micro` of optimizer step `step` is a pure function of
    (seed, step, micro): resuming, changing world_size or skipping ahead never changes it.
    The cursor maps the n-th `next_batch()` call to (step, micro) = divmod(n,
    accumulation_steps).
    """

    kind = "random_window"

    def __init__(
        self,
        tokens: TokenSource,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        accumulation_steps: int = 1,
        summary_trigger: SummaryEventTrigger | None = None,
    ) -> None:
        super().__init__(tokens, block_size, batch_size, seed, rank, world_size, summary_trigger)
        self.accumulation_steps = checks.positive_int("accumulation_steps", accumulation_steps)
        n = int(self.tokens.shape[0])
        if n < self.block_size + 1:
            raise DataError(
                f"{self.source} has {n} tokens, fewer than block_size + 1 = "
                f"{self.block_size + 1}: use a longer source or a smaller block_size"
            )
        self.num_starts = n - self.block_size
        self.step = 0
        self.micro = 0

    def set_accumulation_steps(self, k: int) -> None:
        """Micro-batches per optimizer step (gradient accumulation); the cursor keeps its
        (step, micro) position, which must still be valid."""
        k = checks.positive_int("accumulation_steps", k)
        if self.micro >= k:
            raise ConfigError(
                f"cannot set accumulation_steps={k} while the cursor is at micro-batch "
                f"{self.micro} of step {self.step}; change it at a step boundary"
            )
        self.accumulation_steps = k

    def global_starts(self, step: int, micro: int) -> torch.Tensor:
        """Start offsets of all batch_size windows (every rank's rows) for (step, micro)."""
        gen = torch.Generator().manual_seed(_seed_from(self.seed, int(step), int(micro)))
        return torch.randint(0, self.num_starts, (self.batch_size,), generator=gen)

    def batch_at(self, step: int, micro: int = 0) -> SequenceBatch:
        """This rank's rows of the global batch for (step, micro); does not move the cursor."""
        starts = self.global_starts(step, micro)
        lo = self.rank * self.rows_per_rank
        windows = gather_windows(
            self.tokens, starts[lo : lo + self.rows_per_rank].numpy(), self.block_size + 1
        )
        return windows_to_batch(windows, None, self.summary_trigger)

    def next_batch(self) -> SequenceBatch:
        """The batch at the cursor, then advance it by one micro-batch."""
        batch = self.batch_at(self.step, self.micro)
        self.micro += 1
        if self.micro == self.accumulation_steps:
            self.step, self.micro = self.step + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The cursor, plus the settings that must match for it to mean the same batches."""
        return {
            "kind": self.kind,
            "step": self.step,
            "micro": self.micro,
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; refuses a state saved with a different seed, shape or data."""
        _check_state(state, self.kind, self._fingerprint())
        step, micro = int(state["step"]), int(state["micro"])
        if step < 0 or not 0 <= micro < self.accumulation_steps:
            raise DataError(
                f"loader state cursor (step={step}, micro={micro}) is invalid with "
                f"accumulation_steps={self.accumulation_steps}"
            )
        self.step, self.micro = step, micro

    def _fingerprint(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "num_starts": self.num_starts,
        }


class MixedWindowLoader:
    """Windows of block_size + 1 tokens at uniformly random positions of several sources,
    mixed row by row: row r of every batch is a window of source r mod len(sources) (a merge's
    fine-tune on its sources' domains). One process, no accumulation: batch n (the n-th
    `next_batch()`) is a pure function of (seed, n), as `RandomWindowLoader`'s are of (seed,
    step, micro)."""

    kind = "mixed_window"

    def __init__(
        self,
        sources: Sequence[TokenSource],
        block_size: int,
        batch_size: int,
        seed: int,
        summary_trigger: SummaryEventTrigger | None = None,
    ) -> None:
        if not sources:
            raise ConfigError("a mixed loader needs at least one token source")
        # each source's windows, checked as the training loader checks them
        self.sources = [RandomWindowLoader(s, block_size, batch_size, seed) for s in sources]
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.summary_trigger = summary_trigger
        self.step = 0

    def batch_at(self, step: int) -> SequenceBatch:
        """The batch `step` (0-based); does not move the cursor."""
        gen = torch.Generator().manual_seed(_seed_from(self.seed, int(step), _MIX_TAG))
        rows = []
        for r in range(self.batch_size):
            source = self.sources[r % len(self.sources)]
            start = int(torch.randint(0, source.num_starts, (1,), generator=gen))
            rows.append(np.asarray(source.tokens[start : start + self.block_size + 1]))
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows_to_batch(windows, None, self.summary_trigger)

    def next_batch(self) -> SequenceBatch:
        """The batch at the cursor, then advance it."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch


class _EpochQueueLoader(_RankedLoader):
    """The streaming loaders' shared document queue: each epoch visits documents
    0..num_docs-1 in a permutation seeded by (seed, epoch), and rows take their next document
    from it in row order, so which row reads which document is deterministic."""

    num_docs: int
    kind: str

    def _start_queue(self) -> None:
        self.epoch = 0
        self.position = 0  # next index into the current epoch's permutation
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Document order of `epoch`: a permutation of range(num_docs) seeded by (seed, epoch)."""
        gen = torch.Generator().manual_seed(_seed_from(self.seed, int(epoch), _STREAM_PERM_TAG))
        return torch.randperm(self.num_docs, generator=gen).numpy()

    def _next_doc(self) -> int:
        if self.position == self.num_docs:
            self.epoch, self.position = self.epoch + 1, 0
        if self._perm_epoch != self.epoch:
            self._perm, self._perm_epoch = self.epoch_order(self.epoch), self.epoch
        doc = int(self._perm[self.position])
        self.position += 1
        return doc

    def _row_cursor_ok(self, doc: int, at: int) -> bool:
        """Whether (doc, at) is a row cursor this loader's data allows (-1: no document)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Epoch, queue position and every global row's (document, where it reads next), as
        plain ints, plus the settings that must match for them to mean the same windows."""
        return {
            "kind": self.kind,
            "epoch": self.epoch,
            "position": self.position,
            "rows": [[d, n] for d, n in zip(self.row_doc, self.row_next, strict=True)],
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; refuses a state saved with a different seed, shape or data."""
        _check_state(state, self.kind, self._fingerprint())
        rows = [(int(d), int(n)) for d, n in state["rows"]]
        epoch, position = int(state["epoch"]), int(state["position"])
        if (
            len(rows) != self.batch_size
            or epoch < 0
            or not 0 <= position <= self.num_docs
            or not all(self._row_cursor_ok(d, n) for d, n in rows)
        ):
            raise DataError(f"{self.kind} loader state is inconsistent with this loader's data")
        self.epoch, self.position = epoch, position
        self.row_doc = [d for d, _ in rows]
        self.row_next = [n for _, n in rows]

    def _fingerprint(self) -> dict[str, int]:
        raise NotImplementedError


class StreamingDocumentLoader(_EpochQueueLoader):
    """Consecutive windows of documents, for training with state carried across steps.

    The stream is cut into documents of `logical_length` L tokens (rounded up to a multiple of
    block_size T by `logical_length_for`):
    doc i covers tokens [i*L, i*L + L + 1) and yields L/T windows of T + 1 tokens, window k
    covering [i*L + k*T, i*L + k*T + T + 1), so consecutive windows share one token and every
    target is the next window's first input. Each epoch visits documents in a permutation
    seeded by (seed, epoch). Global row b reads its document's windows in order; a row that
    finishes takes the next document from the shared epoch queue (rows in order, so the
    assignment is deterministic), and the batch's `reset[b]` is True exactly on a document's
    first window. Each call advances every row by one window: a trainer that accumulates k
    micro-batches per step calls it k times and the rows' stored state carries across them.
    """

    kind = "streaming_document"

    def __init__(
        self,
        tokens: TokenSource,
        block_size: int,
        batch_size: int,
        logical_length: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        summary_trigger: SummaryEventTrigger | None = None,
    ) -> None:
        super().__init__(tokens, block_size, batch_size, seed, rank, world_size, summary_trigger)
        self.logical_length = logical_length_for(
            checks.positive_int("logical_length", logical_length), self.block_size
        )
        self.windows_per_doc = self.logical_length // self.block_size
        n = int(self.tokens.shape[0])
        self.num_docs = (n - 1) // self.logical_length
        if self.num_docs < 1:
            raise DataError(
                f"{self.source} has {n} tokens, fewer than logical_length + 1 = "
                f"{self.logical_length + 1} needed for one document: use a longer source or a "
                f"smaller logical_length"
            )
        self._start_queue()
        self.row_doc = [-1] * self.batch_size  # -1: the row has no document yet
        self.row_next = [0] * self.batch_size  # next window index to read in row_doc

    def next_batch(self) -> SequenceBatch:
        """This rank's rows of the next global batch; reset marks rows starting a document."""
        starts: list[int] = []
        reset: list[bool] = []
        for b in range(self.batch_size):  # every rank replays all rows: the queue is shared
            if self.row_doc[b] < 0 or self.row_next[b] == self.windows_per_doc:
                self.row_doc[b], self.row_next[b] = self._next_doc(), 0
            starts.append(
                self.row_doc[b] * self.logical_length + self.row_next[b] * self.block_size
            )
            reset.append(self.row_next[b] == 0)
            self.row_next[b] += 1
        lo, hi = self.rank * self.rows_per_rank, (self.rank + 1) * self.rows_per_rank
        windows = gather_windows(self.tokens, starts[lo:hi], self.block_size + 1)
        history = self._history(starts[lo:hi])
        reset_rows = torch.tensor(reset[lo:hi], dtype=torch.bool)
        return windows_to_batch(windows, reset_rows, self.summary_trigger, history)

    def _history(self, starts: list[int]) -> torch.Tensor | None:
        """The document's tokens just before each window (NO_TOKEN before the document's
        start), so a trigger that spans two windows of a document is still found."""
        k = 0 if self.summary_trigger is None else self.summary_trigger.history_len
        if k == 0:
            return None
        history = torch.full((len(starts), k), NO_TOKEN, dtype=torch.long)
        for row, start in enumerate(starts):
            doc_start = start - start % self.logical_length  # documents start at i * L
            lo = max(start - k, doc_start)
            if lo < start:
                history[row, k - (start - lo) :] = torch.from_numpy(
                    np.asarray(self.tokens[lo:start]).astype(np.int64)
                )
        return history

    def _row_cursor_ok(self, doc: int, window: int) -> bool:
        return -1 <= doc < self.num_docs and 0 <= window <= self.windows_per_doc

    def _fingerprint(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "logical_length": self.logical_length,
            "num_docs": self.num_docs,
        }


def document_starts(data: TokenData) -> np.ndarray:
    """The start offsets of the documents of `data` (int64, strictly increasing, the first 0,
    every one < len(data)): its `doc_starts`, else the token after each end-of-document id.
    Offsets at or beyond the end (a split's tail) are dropped. DataError when `data` has
    neither index."""
    n = len(data)
    if data.doc_starts is not None:
        starts = np.asarray(data.doc_starts, dtype=np.int64)
    elif data.eot_id is not None:
        found = [
            np.flatnonzero(np.asarray(data.tokens[lo : lo + _SCAN_CHUNK]) == data.eot_id) + lo + 1
            for lo in range(0, n, _SCAN_CHUNK)
        ]
        starts = np.concatenate([np.zeros(1, dtype=np.int64), *found])
    else:
        raise DataError(
            f"{data.source} has no document index (no document starts and no end-of-document "
            "token id), so training.stream_documents = 'corpus' cannot find its documents; use "
            "a prepared corpus or a tokenizer with an end-of-document token, or set "
            "training.stream_documents = 'fixed'"
        )
    starts = np.unique(np.concatenate([np.zeros(1, dtype=np.int64), starts]))
    return starts[(starts >= 0) & (starts < n)]


class StreamingCorpusLoader(_EpochQueueLoader):
    """Consecutive windows over the corpus's own documents, for streaming TBPTT.

    Documents are [starts[i], starts[i + 1]) with the starts of `document_starts`. Global row b
    reads a stream made of documents dealt to it from the shared epoch queue (rows in order):
    each call hands it the next T + 1 tokens of that stream, windows overlapping by one token
    as in `StreamingDocumentLoader`. A document longer than the window continues in the row's
    next window; one that ends inside a window is followed, in the same window, by the row's
    next document. The batch's `reset` is a [B, T] mask, True at every input that is a
    document's first token (the model restarts the row there, position 0, empty state), and a
    target that is a document's first token is IGNORE_INDEX: no token is predicted from
    another document. The cursor is each global row's (document, offset of its next window's
    first token) plus the queue's epoch and position.
    """

    kind = "streaming_corpus"

    def __init__(
        self,
        tokens: TokenData,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        summary_trigger: SummaryEventTrigger | None = None,
    ) -> None:
        if summary_trigger is not None:
            raise ConfigError(
                "training.stream_documents = 'corpus' resets rows mid-block, which the summary "
                "memory (and so its write trigger) does not support; turn off "
                "model.summary_memory or set training.stream_documents = 'fixed'"
            )
        if not isinstance(tokens, TokenData):
            raise DataError(
                "the corpus streaming loader needs a TokenData with a document index, got "
                f"{type(tokens).__name__}"
            )
        super().__init__(tokens, block_size, batch_size, seed, rank, world_size)
        n = int(self.tokens.shape[0])
        if n < 2:
            raise DataError(f"{self.source} has {n} token(s): streaming needs at least 2")
        starts = document_starts(tokens)
        self.doc_bounds = np.append(starts, n)  # document i is [bounds[i], bounds[i + 1])
        self.num_docs = int(starts.shape[0])
        if self.num_docs < self.batch_size:  # rows would start the same documents together
            raise DataError(
                f"{self.source} has {self.num_docs} document(s), fewer than the batch's "
                f"{self.batch_size} rows, so rows would read the same text side by side: "
                "stream a corpus of at least batch_size documents, or set "
                "training.stream_documents = 'fixed'"
            )
        self._start_queue()
        self.row_doc = [-1] * self.batch_size  # -1: the row has no document yet
        self.row_next = [0] * self.batch_size  # next window's first token in row_doc

    def doc_length(self, doc: int) -> int:
        return int(self.doc_bounds[doc + 1] - self.doc_bounds[doc])

    def _advance_row(self, b: int) -> list[tuple[int, int, bool]]:
        """Move row b on by one window; its pieces (absolute start, length, starts a
        document) cover the window's T + 1 tokens in order."""
        pieces, need = [], self.block_size + 1
        while need:
            if self.row_doc[b] < 0 or self.row_next[b] == self.doc_length(self.row_doc[b]):
                self.row_doc[b], self.row_next[b] = self._next_doc(), 0
            doc, offset = self.row_doc[b], self.row_next[b]
            take = min(need, self.doc_length(doc) - offset)
            pieces.append((int(self.doc_bounds[doc]) + offset, take, offset == 0))
            self.row_next[b] += take
            need -= take
        self.row_next[b] -= 1  # the window's last token is the next window's first
        return pieces

    def next_batch(self) -> SequenceBatch:
        """This rank's rows of the next global batch, with their [B, T] reset mask."""
        lo, hi = self.rank * self.rows_per_rank, (self.rank + 1) * self.rows_per_rank
        width = self.block_size + 1
        windows = torch.empty((hi - lo, width), dtype=torch.long)
        starts_doc = torch.zeros((hi - lo, width), dtype=torch.bool)
        for b in range(self.batch_size):  # every rank replays all rows: the queue is shared
            pieces = self._advance_row(b)
            if not lo <= b < hi:
                continue
            column = 0
            for start, length, first in pieces:
                piece = np.asarray(self.tokens[start : start + length]).astype(np.int64)
                windows[b - lo, column : column + length] = torch.from_numpy(piece)
                starts_doc[b - lo, column] = first
                column += length
        targets = windows[:, 1:].masked_fill(starts_doc[:, 1:], IGNORE_INDEX)
        return SequenceBatch(
            windows[:, :-1].contiguous(), targets.contiguous(), starts_doc[:, :-1].contiguous()
        )

    def _row_cursor_ok(self, doc: int, offset: int) -> bool:
        if (doc, offset) == (-1, 0):
            return True
        return 0 <= doc < self.num_docs and 0 <= offset < self.doc_length(doc)

    def _fingerprint(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "num_tokens": int(self.tokens.shape[0]),
            "num_docs": self.num_docs,
        }


def _check_state(state: dict[str, Any], kind: str, expected: dict[str, int]) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise DataError(f"loader state is for {got!r}, not {kind!r}; was data.loader changed?")
    changed = [k for k, v in expected.items() if state.get(k) != v]
    if changed:
        diffs = [f"{k}: saved {state.get(k)!r}, now {expected[k]!r}" for k in changed]
        # only the data's sizes differ (starts depend on the block, documents on the logical
        # length: a change of those is a settings change)
        other_data = set(changed) <= {"num_tokens", "num_docs", "num_starts"}
        hint = (
            ": data.source names other text than the run trained on (a resume may only name "
            "where its corpus moved); give the run's data, or train on this data from these "
            "weights in a new run (checkpoint.init_from)"
            if other_data
            else "; resume with the original settings or start a fresh run"
        )
        raise DataError(
            f"cannot resume the {kind} loader: its settings or data changed since the checkpoint "
            f"({'; '.join(diffs)}){hint}"
        )
