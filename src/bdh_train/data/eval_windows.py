"""Evaluation windows: every window of a split in order, or one sampled from each equal
stretch of it at a fixed seed, in batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from bdh_train import checks
from bdh_train.batch import SequenceBatch
from bdh_train.data.events import SummaryEventTrigger
from bdh_train.data.loaders import TokenSource, as_tokens, gather_windows, windows_to_batch
from bdh_train.errors import ConfigError, DataError


def eval_window_count(n_tokens: int, block_size: int) -> int:
    """The evaluation windows of `n_tokens` tokens (`eval_batches`): each predicts
    `block_size` of them, after the first token."""
    return (n_tokens - 1) // block_size


def eval_batches(
    tokens: TokenSource,
    block_size: int,
    batch_size: int,
    max_batches: int | None = None,
    summary_trigger: SummaryEventTrigger | None = None,
) -> Iterator[SequenceBatch]:
    """Deterministic evaluation batches of windows: window j covers [j*T, j*T + T + 1), so
    every token after the first of the windows read is predicted exactly once. max_batches
    None (or enough batches for every window) reads all windows in order, the last batch
    maybe short; fewer batches read `sampled_windows` of them, spread across the whole data.
    Each call starts over, so repeated evals see identical data. With a summary trigger the
    batches carry their summary event mask (per window)."""
    arr, source = as_tokens(tokens)
    block_size = checks.positive_int("block_size", block_size)
    batch_size = checks.positive_int("batch_size", batch_size)
    if max_batches is not None and (isinstance(max_batches, bool) or max_batches < 0):
        raise ConfigError(f"max_batches must be None or >= 0, got {max_batches!r}")
    n_windows = eval_window_count(int(arr.shape[0]), block_size)
    if n_windows < 1:
        raise DataError(
            f"validation data from {source} has {arr.shape[0]} tokens, fewer than block_size + "
            f"1 = {block_size + 1}: use a larger data.val_fraction or a smaller block_size"
        )
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, int(max_batches))
    windows = sampled_windows(n_windows, n_batches * batch_size)
    return _eval_iter(arr, block_size, batch_size, windows, summary_trigger)


EVAL_SAMPLE_SEED = 0
"""The seed of the windows a partial evaluation reads (`sampled_windows`): a constant, so
every evaluation of a split (a run's, a resumed run's, `bdh-train eval`'s) reads the same."""


def sampled_windows(n_windows: int, wanted: int) -> np.ndarray:
    """The evaluation windows read of `n_windows` when `wanted` are: every window in order
    when wanted >= n_windows; else one from each of `wanted` equal strata (stratum i =
    [i * n // wanted, (i + 1) * n // wanted)), at an offset drawn with EVAL_SAMPLE_SEED, in
    order: a fixed sample spread across the whole split, not its first `wanted` windows."""
    if wanted >= n_windows or wanted <= 0:
        return np.arange(min(n_windows, max(wanted, 0)))
    edges = np.arange(wanted + 1, dtype=np.int64) * n_windows // wanted
    offsets = np.random.default_rng(EVAL_SAMPLE_SEED).integers(0, edges[1:] - edges[:-1])
    return edges[:-1] + offsets


def _eval_iter(
    arr: np.ndarray,
    block_size: int,
    batch_size: int,
    windows: np.ndarray,
    trigger: SummaryEventTrigger | None,
) -> Iterator[SequenceBatch]:
    # A separate generator so eval_batches raises its errors at the call, not at first next().
    for i in range(0, len(windows), batch_size):
        js = windows[i : i + batch_size]
        yield windows_to_batch(gather_windows(arr, js * block_size, block_size + 1), None, trigger)
