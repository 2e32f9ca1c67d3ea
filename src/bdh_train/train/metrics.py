"""What a run records: metrics rows (metrics.jsonl, and TensorBoard or Weights & Biases when
`[metrics] report_to` names them) and loss.png. What it prints is train/console.py's."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from bdh_train import checks
from bdh_train.errors import ConfigError, DataError
from bdh_train.train.config import every_and_last
from bdh_train.train.run_dir import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR, append_line
from bdh_train.utils import atomic_write

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
        append_line(self.path, json.dumps(row))  # never through a link

    def close(self, failed: bool = False) -> None:
        pass


class MetricsReporter:
    """metrics.jsonl plus the backends `MetricsConfig.report_to` names, each given every row.
    Disabled (writes nothing anywhere) on every process but the main one."""

    def __init__(
        self,
        run_dir: Path,
        cfg: MetricsConfig,
        resume_step: int | None = None,
        enabled: bool = True,
        config: dict[str, Any] | None = None,
        config_text: str = "",
        log_every: int = 0,
        last_step: int = 0,
    ) -> None:
        """`log_every` and `last_step` set which optimizer steps `log_step` writes."""
        self.log_every, self.last_step = log_every, last_step
        self._clock = (time.perf_counter(), 0)
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
        for sink in self.sinks:
            sink.write(row)

    def should_log(self, step: int) -> bool:
        """Every `log_every` optimizer steps and the last one; never with log_every = 0."""
        return every_and_last(step, self.log_every, self.last_step)

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
        row["elapsed_s"] = elapsed
        self._clock = (now, row["tokens"])
        self.write(row)

    def close(self, failed: bool = False) -> None:
        """Flush and close every backend (once; later calls do nothing)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed)


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
