"""What a run records: metrics rows (metrics.jsonl, and TensorBoard or Weights & Biases when
`[metrics] report_to` names them) and loss.png. What it prints is train/console.py's."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from bdh_train import checks
from bdh_train.errors import ConfigError, DataError
from bdh_train.storage.run_dir import (
    METRICS_FILE,
    PLOT_FILE,
    TENSORBOARD_DIR,
    RunDir,
    append_line,
)
from bdh_train.train.config import every_and_last
from bdh_train.utils import atomic_write, json_kind, open_regular, read_lines

WANDB_MODES = ("offline", "online")
REPORT_TARGETS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}
"""Where metrics rows can go -> the package that target needs (None: nothing extra)."""


@dataclass
class MetricsConfig:
    """Where the metrics rows of a run go. ``metrics.jsonl`` is always written: ``plot`` and
    resume read it; the other targets get the same rows. Only the main process writes."""

    report_to: list[str] = field(default_factory=lambda: ["jsonl"])
    """Any of ``jsonl``, ``tensorboard`` (event files in ``<run>/tensorboard``, through
    ``torch.utils.tensorboard``) and ``wandb`` (the Weights & Biases client, files in
    ``<run>/wandb``)."""
    wandb_project: str = "bdh-train"
    """The W&B project the run is logged to."""
    wandb_mode: str = "offline"
    """``offline`` (written to ``<run>/wandb``, no network; ``wandb sync`` uploads it later)
    or ``online``."""

    def validate(self, prefix: str = "metrics") -> MetricsConfig:
        if not isinstance(self.report_to, (list, tuple)):
            raise ConfigError(
                f'{prefix}.report_to must be a list such as ["jsonl", "tensorboard"], '
                f"got {self.report_to!r}"
            )
        for target in self.report_to:
            checks.choice(f"{prefix}.report_to[]", target, tuple(REPORT_TARGETS))
            package = REPORT_TARGETS[target]
            if package is not None and importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"{prefix}.report_to names {target!r} but the {package!r} package is not "
                    f"installed: pip install {package}, or remove {target!r} from the list"
                )
        checks.string(f"{prefix}.wandb_project", self.wandb_project)
        checks.choice(f"{prefix}.wandb_mode", self.wandb_mode, WANDB_MODES)
        return self


class MetricsSink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row other than its step (what scalar backends plot)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key != "step"
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class TensorBoardSink:
    """Every row's numbers as scalars at its step, and the run's config as text. On resume,
    events past the checkpoint's step are purged, as metrics.jsonl's rows are."""

    def __init__(self, run_dir: Path, resume_step: int | None, config_text: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge)
        if resume_step is None:
            self.writer.add_text("config", "```toml\n" + config_text + "\n```", 0)

    def write(self, row: dict[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbSink:
    """Rows logged to one W&B run per run directory (a resumed run continues it); its summary
    holds each metric's last value."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, config: dict[str, Any]) -> None:
        import wandb

        run_dir = Path(run_dir).resolve()
        self.run = wandb.init(
            project=cfg.wandb_project,
            dir=str(run_dir),
            mode=cast(Literal["offline", "online"], cfg.wandb_mode),  # one of WANDB_MODES
            id=hashlib.sha256(str(run_dir).encode()).hexdigest()[:16],
            resume="allow",
            name=run_dir.name,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MetricsLog:
    """Appends one JSON object per row; on resume, rows past the checkpoint are dropped."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, enabled: bool = True):
        """On resume, rows past the checkpoint's step (and a torn last line) are dropped."""
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self.dropped_torn_line = False
        if enabled and resume_step is not None and self.path.exists():
            rows, self.dropped_torn_line = _read_rows(self.path)
            kept = [r for r in rows if r["step"] <= resume_step]
            with atomic_write(self.path) as handle:
                for row in kept:
                    handle.write(json.dumps(row) + "\n")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps(row))  # never through a link

    def close(self, failed: bool = False) -> None:
        pass


class MetricsReporter:
    """metrics.jsonl plus the backends `MetricsConfig.report_to` names, each given every row.
    Disabled (writes nothing anywhere) on every process but the main one."""

    def __init__(
        self,
        run: RunDir,
        cfg: MetricsConfig,
        resume_step: int | None = None,
        enabled: bool = True,
        config: dict[str, Any] | None = None,
        config_text: str = "",
        log_every: int = 0,
        last_step: int = 0,
    ) -> None:
        """`log_every` and `last_step` set which optimizer steps `log_step` writes. Every row
        and the plot are written only while `run` is still this run's (`RunDir.check_owned`)."""
        self.run, run_dir = run, run.path
        self.log_every, self.last_step = log_every, last_step
        self._clock = (time.perf_counter(), 0)
        self.mfu: Callable[[float], float] | None = None
        """The MFU of a tokens-per-second rate (`Throughput.mfu`), written as each row's mfu."""
        self.jsonl = MetricsLog(run_dir, resume_step, enabled)
        self.sinks: list[MetricsSink] = [self.jsonl]
        if not enabled:
            return
        if "tensorboard" in cfg.report_to:
            self.sinks.append(TensorBoardSink(Path(run_dir), resume_step, config_text))
        if "wandb" in cfg.report_to:
            self.sinks.append(WandbSink(Path(run_dir), cfg, config or {}))

    @property
    def path(self) -> Path:
        return self.jsonl.path

    @property
    def dropped_torn_line(self) -> bool:
        return self.jsonl.dropped_torn_line

    def write(self, row: dict[str, Any]) -> None:
        self.run.check_owned()
        for sink in self.sinks:
            sink.write(row)

    def plot(self) -> None:
        """The run's loss curves (`plot_losses`), on the main process only."""
        if self.jsonl.enabled:
            self.run.check_owned()
            plot_losses(self.run.path)

    def should_log(self, step: int) -> bool:
        """The run's first optimizer step (so its curve starts where the console's first line
        does), every `log_every` steps and the last one; never with log_every = 0."""
        return every_and_last(step, self.log_every, self.last_step) or (
            bool(self.log_every) and step == 1
        )

    def restart_clock(self, tokens: int) -> None:
        """Time tokens_per_s from now, with `tokens` counted so far."""
        self._clock = (time.perf_counter(), tokens)

    def log_step(self, row: dict[str, Any], elapsed: float) -> None:
        """Write an optimizer step's row when one is due, with the tokens per second since the
        last written row and the training seconds so far (added to `row`)."""
        if not self.should_log(row["step"]):
            return
        now = time.perf_counter()
        since, tokens = self._clock
        row["tokens_per_s"] = (row["tokens"] - tokens) / max(now - since, 1e-9)
        if self.mfu is not None:
            row["mfu"] = self.mfu(row["tokens_per_s"])
        row["elapsed_s"] = elapsed
        self._clock = (now, row["tokens"])
        self.write(row)

    def close(self, failed: bool = False) -> None:
        """Flush and close every backend (once; later calls do nothing)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed)


METRICS_LINE_MAX_BYTES = 1 << 20
"""The longest metrics.jsonl line read: a row as written has a few hundred bytes."""
ROW_EXAMPLE = '{"step": 3, "loss": 2.5}'


def row_problem(row: object) -> str | None:
    """What keeps a parsed JSON value from being a metrics row, or None when it is one: a
    JSON object whose "step" is a non-negative integer and whose other values are numbers
    (NaN and Infinity too: a diverged loss is written as NaN), what every reader of the rows
    (resume, `plot`, `profile`, the backends) relies on."""
    if not isinstance(row, dict):
        return f"a JSON {json_kind(row)}, not an object"
    if "step" not in row:
        return 'no "step"'
    step = row["step"]
    if not checks.is_int(step) or step < 0:
        shown = step if json_kind(step) == "number" else f"a JSON {json_kind(step)}"
        return f'"step" is {shown}, not a non-negative integer'
    for key, value in row.items():
        if json_kind(value) != "number":
            return f"{json.dumps(key)} is a JSON {json_kind(value)}, not a number"
    return None


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of metrics.jsonl (`read_metrics`), and whether a torn last line was left out."""
    rows: list[dict[str, Any]] = []
    torn: tuple[int, str] | None = None  # the first line that is no JSON, and why
    try:
        with open_regular(path, str(path), DataError) as handle:
            for number, line in read_lines(handle, METRICS_LINE_MAX_BYTES, str(path), DataError):
                if not line.strip():
                    continue
                if torn is not None:  # a line after it: that one was no torn last line
                    break
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, too deep
                    torn = (number, f"not JSON: {exc}")
                    continue
                problem = row_problem(row)
                if problem is not None:
                    raise DataError(_bad_line(path, number, problem))
                rows.append(row)
            else:
                return rows, torn is not None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    assert torn is not None  # the loop breaks only after a line that is no JSON
    raise DataError(_bad_line(path, *torn))


def _bad_line(path: Path, number: int, problem: str) -> str:
    return (
        f"{path}:{number}: {problem}; each line is a metrics row such as {ROW_EXAMPLE}: "
        "correct that line or delete it to go on"
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl (a regular file, lines of at most METRICS_LINE_MAX_BYTES),
    each checked by `row_problem`; a torn last line (what a full disk or a kill mid-write
    leaves: no JSON) is left out. Any other bad line is a DataError naming it."""
    return _read_rows(path)[0]


ACTIVITY_KEYS = ("x_active", "y_active", "xy_active", "dead", "always_on")
"""The evaluation's activity numbers (model/activity.py) `plot_losses` draws under the loss."""


def plot_losses(run_dir: Path) -> Path:
    """Draw train and validation loss against step into run_dir/loss.png, and below them the
    evaluations' neuron activity where the rows hold it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(Path(run_dir) / METRICS_FILE)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    activity = {k: [(r["step"], r[k]) for r in rows if k in r] for k in ACTIVITY_KEYS}
    panels = 2 if any(activity.values()) else 1
    height = 4.2 * panels  # inches
    fig = Figure(figsize=(7, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(panels, 1, 1)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", color="tab:blue")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if panels == 2:
        ax = fig.add_subplot(2, 1, 2)
        for key, points in activity.items():
            if points:
                ax.plot(*zip(*points, strict=True), "o-", label=key)
        ax.set_xlabel("step")
        ax.set_ylabel("share (validation tokens, all layers)")
        ax.grid(alpha=0.3)
        ax.legend()
    # fixed margins, room for the tick labels and axis titles (left and right as shares of
    # the width, top and bottom 0.2 and 0.5 inches): a tight layout would lay out every text
    # twice, most of the plot's time
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.2 / height, bottom=0.5 / height)
    out = Path(run_dir) / PLOT_FILE
    with atomic_write(out, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    return out


COMPARE_X = ("step", "tokens")
"""What `plot_runs` may put on its x axis: optimizer steps, or training tokens (runs of
different batches or blocks compared at equal data)."""


def plot_runs(runs: Sequence[Path], x: str = "step") -> bytes:
    """One chart of several run directories, each labelled by its name (by its path where
    two share a name): its train loss as a line and its validation losses as dots of the same
    colour, against `x` (COMPARE_X). A validation row, which holds no token count, is placed
    at its step's tokens, read off the train rows (linear between the logged ones). A run
    with nothing to draw on that axis is a ConfigError naming it. PNG bytes."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    checks.choice("--x", x, COMPARE_X)
    names = [Path(run).resolve().name for run in runs]
    labels = [n if names.count(n) == 1 else str(r) for n, r in zip(names, runs, strict=True)]
    fig = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for run_dir, label, color in zip(runs, labels, _colors(len(runs)), strict=True):
        rows = read_metrics(Path(run_dir) / METRICS_FILE)
        train = [(r["step"], r.get("tokens"), r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if x == "tokens" and (not train or any(t[1] is None for t in train)):
            raise ConfigError(
                f"{run_dir}: its metrics rows hold no training tokens to draw against "
                "(a merge's fine-tune rows hold none): plot it with --x step"
            )
        if not train and not val:
            raise ConfigError(f"{run_dir}: its metrics.jsonl holds no loss to draw")
        scale = ([t[0] for t in train], [t[1] for t in train])  # tokens at the logged steps
        if train:
            xs = _on_axis([t[0] for t in train], x, scale)
            ax.plot(xs, [t[2] for t in train], color=color, label=label)
        if val:
            xs, shown = _on_axis([v[0] for v in val], x, scale), f"{label} (validation)"
            ax.plot(xs, [v[1] for v in val], "o--", color=color, label=shown)
    ax.set_xlabel("step" if x == "step" else "training tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.subplots_adjust(left=0.1, right=0.98, top=0.95, bottom=0.12)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _on_axis(steps: list[int], x: str, scale: tuple[list[int], list[Any]]) -> list[float]:
    """`steps` on `plot_runs`'s x axis: themselves, or the training tokens at them, read off
    the train rows' (step, tokens) `scale` (linear between them, held past its ends)."""
    import numpy as np

    if x == "step":
        return [float(step) for step in steps]
    return [float(v) for v in np.interp(steps, *scale)]


def _colors(n: int) -> list[Any]:
    """`n` distinct colours: matplotlib's ten, then a colormap's."""
    from matplotlib import colormaps

    if n <= 10:
        return [f"C{i}" for i in range(n)]
    cmap = colormaps["viridis"]
    return [cmap(i / (n - 1)) for i in range(n)]
