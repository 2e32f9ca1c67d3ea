"""What the carried state remembers, measured on held-out text.

Context curve: R stretches of L + 1 consecutive tokens are each read twice, once with the
state carried through all L tokens and once in independent blocks of the training length B
(each from a fresh state, as in training). Target t (1 <= t <= L) is predicted after t tokens
of its stretch in the carried reading and after ((t - 1) mod B) + 1 in the blocks. The mean
loss is reported per bucket of t, log-spaced: [1, 2), [2, 4), [4, 8), ..., the last holding
t = L (`log_buckets`). Up to B the two readings are the same computation; beyond it the
carried curve falling below the blocks' says the state uses more context than a block holds.

Retention: K chunks of C consecutive tokens; each chunk k >= 1 is scored three ways on the
same targets: `window` (a fresh state reads chunk k - 1 then chunk k: the previous chunk and
nothing older), `carried` (the state carried from chunk 0 through every chunk before k) and
`reset` (a fresh state at chunk k). reset - window is what the state keeps of the previous
chunk; window - carried is what it keeps from further back. (For BDH, reading the previous
chunk in the same call as chunk k and carrying the state between two calls are one
computation, so "in context" and "through the state" need no separate column.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bdh_train.data.tokens import TokenData
from bdh_train.errors import ConfigError, DataError
from bdh_train.evals.scoring import score_sequences
from bdh_train.model.bdh import BDH
from bdh_train.model.summary import SummaryEvents
from bdh_train.train.config import TrainingConfig
from bdh_train.utils import atomic_write, steps_cap

STATE_GAIN_BLOCKS = 32
"""Training blocks per stretch of the end-of-run state-gain line's context curve: its last
bucket holds the targets 16 to 32 blocks into a stretch."""
STATE_GAIN_SEQUENCES = 4
"""Stretches of the state-gain line's context curve, at most (fewer when the validation split
is shorter; one when `steps_cap` shortens the command for a smoke test)."""


def stretches(tokens: np.ndarray, rows: int, length: int, what: str) -> list[list[int]]:
    """`rows` consecutive stretches of length + 1 tokens from the start of `tokens` (each
    shares its last token with the next one's first): rows * length + 1 tokens in all."""
    need = rows * length + 1
    if len(tokens) < need:
        raise DataError(
            f"{what} needs {need:,} tokens of evaluation data ({rows} x {length:,} + 1) but it "
            f"has {len(tokens):,}: pass less, or --data a longer source"
        )
    flat = np.asarray(tokens[:need], dtype=np.int64)
    return [flat[r * length : (r + 1) * length + 1].tolist() for r in range(rows)]


def log_buckets(length: int) -> list[int]:
    """Edges of the position buckets [1, 2), [2, 4), ..., the last ending at length + 1 (a
    power-of-two length ends the bucket before it, not a bucket of one position)."""
    edges = [1]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    return [*edges, length + 1]


@dataclass
class ContextCurve:
    """Mean loss (nats per token) by position bucket, carried and in blocks."""

    block_size: int
    length: int
    sequences: int
    edges: list[int]
    """Bucket b holds positions edges[b] <= t < edges[b + 1]."""
    tokens: list[int]
    """Targets per bucket (over all sequences)."""
    carried: list[float]
    blocks: list[float]

    def table(self) -> str:
        lines = [
            f"context curve: {self.sequences} x {self.length:,} tokens, blocks of "
            f"{self.block_size} (loss in nats/token; gain = blocks - carried, > 0: the state "
            "helps)",
            f"{'positions':>17} {'targets':>9} {'carried':>9} {'blocks':>9} {'gain':>8}",
        ]
        for b, (carried, blocks) in enumerate(zip(self.carried, self.blocks, strict=True)):
            span = f"{self.edges[b]}-{self.edges[b + 1] - 1}"
            gap = blocks - carried
            lines.append(
                f"{span:>17} {self.tokens[b]:>9,} {carried:9.4f} {blocks:9.4f} {gap:+8.4f}"
            )
        return "\n".join(lines)

    def last_bucket_line(self) -> str:
        """One line on the last bucket (the farthest positions): the loss read with the state
        carried against the loss in fresh blocks, and their difference."""
        gain = self.blocks[-1] - self.carried[-1]
        verdict = "the state helps" if gain > 0 else "the state does not help"
        return (
            f"state gain     {gain:+.4f} nats/token at positions {self.edges[-2]:,}-"
            f"{self.edges[-1] - 1:,} of held-out text ({verdict}): state carried "
            f"{self.carried[-1]:.4f}, fresh blocks of {self.block_size:,} {self.blocks[-1]:.4f}"
        )


def context_curve(
    model: BDH,
    tokens: np.ndarray,
    block_size: int,
    length: int,
    sequences: int,
    batch_size: int,
    summary_events: SummaryEvents | None = None,
) -> ContextCurve:
    """The context curve (module docstring) of `sequences` stretches of `length` tokens (a
    multiple of `block_size`) from the start of `tokens`."""
    if length < block_size or length % block_size:
        raise ConfigError(
            f"--length must be a multiple of the training block ({block_size}), got {length}"
        )
    rows = stretches(tokens, sequences, length, "--context-curve")
    carried = score_sequences(model, rows, batch_size, summary_events)
    blocks = [
        row[start : start + block_size + 1]
        for row in rows
        for start in range(0, length, block_size)
    ]
    block_scores = score_sequences(model, blocks, batch_size, summary_events)
    carried_loss = -np.stack([s.log_probs for s in carried])
    blocks_loss = -np.concatenate([s.log_probs for s in block_scores]).reshape(sequences, length)
    edges = log_buckets(length)
    counts, carried_means, blocks_means = [], [], []
    for lo, hi in zip(edges, edges[1:], strict=False):
        counts.append(sequences * (hi - lo))  # position t is column t - 1
        carried_means.append(float(carried_loss[:, lo - 1 : hi - 1].mean()))
        blocks_means.append(float(blocks_loss[:, lo - 1 : hi - 1].mean()))
    return ContextCurve(block_size, length, sequences, edges, counts, carried_means, blocks_means)


def state_gain_line(
    model: BDH,
    val: TokenData | None,
    training: TrainingConfig,
    summary_events: SummaryEvents | None = None,
) -> str | None:
    """The end-of-run line of `bdh-train train` on what the carried state gained on held-out
    text (the model in eval mode, with a token head): the context curve over the validation
    split `val` (`STATE_GAIN_BLOCKS` training blocks, up to `STATE_GAIN_SEQUENCES`
    stretches, in batches of the run's), its last bucket read with the state carried against
    in fresh blocks. None for a validation split shorter than one stretch."""
    if val is None:
        return None
    length = STATE_GAIN_BLOCKS * training.block_size
    most = 1 if steps_cap() is not None else STATE_GAIN_SEQUENCES
    sequences = min(most, (len(val) - 1) // length)
    if sequences < 1:
        return None
    curve = context_curve(
        model,
        val.tokens,
        training.block_size,
        length,
        sequences,
        training.batch_size,
        summary_events,
    )
    return curve.last_bucket_line()


def plot_context_curve(curve: ContextCurve, path: str | os.PathLike[str]) -> Path:
    """Loss against position (log scale), carried and in blocks, written atomically as a
    PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    middles = [(lo * (hi - 1)) ** 0.5 for lo, hi in zip(curve.edges, curve.edges[1:], strict=False)]
    ax.plot(middles, curve.carried, "o-", label="state carried", color="tab:blue")
    ax.plot(middles, curve.blocks, "s--", label=f"blocks of {curve.block_size}", color="tab:red")
    ax.axvline(curve.block_size, color="grey", alpha=0.5, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the sequence (tokens read before the target)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"context curve: {curve.sequences} x {curve.length:,} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_png(fig, path)


def plot_grid(
    accuracy: list[list[float]],
    columns: list[str],
    rows: list[str],
    xlabel: str,
    ylabel: str,
    title: str,
    path: str | os.PathLike[str],
) -> Path:
    """A heat map of accuracies in [0, 1] (accuracy[i][j]: row i, column j), each cell
    labelled with its value, written atomically as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.2 * len(columns) + 2.5, 0.6 * len(rows) + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(accuracy, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    for i, row in enumerate(accuracy):
        for j, value in enumerate(row):
            colour = "black" if value > 0.5 else "white"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=colour, fontsize=8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return save_png(fig, path)


def save_png(fig, path: str | os.PathLike[str]) -> Path:
    """Write a matplotlib figure to `path` as a PNG, atomically."""
    out = Path(path)
    with atomic_write(out, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    return out


@dataclass
class Retention:
    """Per chunk k >= 1: mean loss (nats per token) read three ways (module docstring)."""

    chunk: int
    window: list[float]
    carried: list[float]
    reset: list[float]

    def table(self) -> str:
        lines = [
            f"retention: chunks of {self.chunk} tokens (loss in nats/token)",
            f"{'chunk':>6} {'window':>9} {'carried':>9} {'reset':>9}",
        ]
        for k, row in enumerate(zip(self.window, self.carried, self.reset, strict=True), 1):
            lines.append(f"{k:>6} " + " ".join(f"{v:9.4f}" for v in row))
        means = [float(np.mean(v)) for v in (self.window, self.carried, self.reset)]
        lines.append(f"{'mean':>6} " + " ".join(f"{v:9.4f}" for v in means))
        return "\n".join(lines)


def retention(
    model: BDH,
    tokens: np.ndarray,
    chunk: int,
    chunks: int,
    batch_size: int,
    summary_events: SummaryEvents | None = None,
) -> Retention:
    """Retention (module docstring) over `chunks` chunks of `chunk` tokens from the start of
    `tokens` (chunks >= 2: chunk 0 is only ever context)."""
    if chunks < 2 or chunk < 1:
        raise ConfigError(f"--chunks must be at least 2 (got {chunks}): chunk 0 is only context")
    (stream,) = stretches(tokens, 1, chunks * chunk, "--retention")
    (carried,) = score_sequences(model, [stream], batch_size, summary_events)
    pieces = [stream[k * chunk : (k + 1) * chunk + 1] for k in range(1, chunks)]
    windows = [stream[(k - 1) * chunk : (k + 1) * chunk + 1] for k in range(1, chunks)]
    reset = score_sequences(model, pieces, batch_size, summary_events)
    window = score_sequences(model, windows, batch_size, summary_events)
    return Retention(
        chunk,
        [-float(s.log_probs[chunk:].mean()) for s in window],
        [-float(carried.log_probs[k * chunk : (k + 1) * chunk].mean()) for k in range(1, chunks)],
        [-float(s.log_probs.mean()) for s in reset],
    )
