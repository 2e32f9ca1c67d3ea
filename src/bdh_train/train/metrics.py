"""What a run reports: metrics.jsonl rows, a progress bar or plain log lines, loss.png."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from bdh_train.errors import DataError
from bdh_train.utils import atomic_write

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLog:
    """Appends one JSON object per row; on resume, rows past the checkpoint are dropped."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, enabled: bool = True):
        """On resume, rows past the checkpoint's step (and a torn last line) are dropped."""
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self.dropped_torn_line = False
        if enabled and resume_step is not None and self.path.exists():
            rows = read_metrics(self.path)
            lines = [x for x in self.path.read_text(errors="replace").splitlines() if x.strip()]
            self.dropped_torn_line = len(rows) < len(lines)
            kept = [r for r in rows if r.get("step", 0) <= resume_step]
            with atomic_write(self.path) as handle:
                for row in kept:
                    handle.write(json.dumps(row) + "\n")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl; a torn last line (what a full disk or a kill mid-write
    leaves) is left out. A damaged line before the last is an error naming it."""
    lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise DataError(
                f"{path} line {number} is not a JSON row ({exc}); delete that line to go on"
            ) from exc
    return rows


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """A tqdm bar on a terminal, with the loss lines written above it (`tqdm.write`) so they
    stay visible; plain lines otherwise (no bar spam in logs). A loss line is printed for the
    first step of a session, every `log_every` steps, the last step, and, on a pipe, at least
    every `heartbeat_s` seconds; each says step/total, tokens seen, tok/s and the ETA."""

    def __init__(
        self,
        total: int,
        initial: int,
        stream: IO[str] | None = None,
        enabled: bool = True,
        log_every: int = 0,
        initial_tokens: int = 0,
        heartbeat_s: float = 30.0,
        clock: Any = time.perf_counter,
    ):
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.total, self.initial, self.initial_tokens = total, initial, initial_tokens
        self.log_every, self.heartbeat_s, self.clock = log_every, heartbeat_s, clock
        self.started = self.last_line = clock()
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(
                total=total, initial=initial, file=self.stream, unit="step", dynamic_ncols=True
            )

    def restart_clock(self) -> None:
        """Time tok/s and the ETA from now (the start of the first step)."""
        self.started = self.last_line = self.clock()

    def _due(self, step: int, now: float) -> bool:
        if step == self.initial + 1 or step == self.total:
            return True
        if self.log_every and step % self.log_every == 0:
            return True
        return self.bar is None and now - self.last_line >= self.heartbeat_s

    def line(self, row: dict[str, Any], now: float) -> str:
        """One loss line: step/total, loss, lr, gradient norm, tokens seen, tok/s, ETA."""
        step, done = row["step"], row["step"] - self.initial
        spent = max(now - self.started, 1e-9)
        rate = (row["tokens"] - self.initial_tokens) / spent
        eta = (self.total - step) * spent / max(done, 1)
        width = len(str(self.total))
        return (
            f"step {step:>{width}}/{self.total} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"grad_norm {row['grad_norm']:.3f} | {row['tokens']:,} tok | {rate:,.0f} tok/s | "
            f"ETA {format_duration(eta)}"
        )

    def update(self, step: int, row: dict[str, Any] | None) -> None:
        """Advance to `step`; `row` is that optimizer step's metrics (step, tokens, loss, lr,
        grad_norm), printed as a loss line when one is due."""
        if not self.enabled:
            return
        now = self.clock()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if row is not None:
                self.bar.set_postfix(loss=f"{row['loss']:.4f}")
        if row is not None and self._due(step, now):
            self.log(self.line(row, now))
            self.last_line = now

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot_losses(run_dir: Path) -> Path:
    """Draw train and validation loss against step into run_dir/loss.png."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(Path(run_dir) / METRICS_FILE)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", color="tab:blue")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    with atomic_write(out, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    return out
