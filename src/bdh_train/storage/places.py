"""The names of a run directory's files and of a checkpoint's weights: what makes a directory
a run or a checkpoint, which the output policy (`storage.output`) never writes into. The run
directory's own module (storage/run_dir.py) describes the layout."""

from __future__ import annotations

from pathlib import Path

BYTES = "bytes"
"""The `data.tokenizer` value of the byte tokenizer (no tokenizer file)."""
CONFIG_FILE = "config.toml"
TOKENIZER_FILE = "tokenizer.json"
"""The file a Hugging Face tokenizer is stored in: in a run directory, a checkpoint, a
prepared corpus directory."""
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
PROFILE_FILE = "profile.png"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS = "checkpoints"
WANDB_DIR = "wandb"
"""Where the Weights & Biases client keeps an offline run (metrics.report_to = ["wandb"])."""
LOCK_FILE = ".lock"
ERROR_LOG = "error.log"
"""Left by a failed start; it does not make a directory 'used', and a fresh run started in
the directory removes it (`RunDir.forget_failed_starts`)."""
LAYOUT = (
    CONFIG_FILE,
    TOKENIZER_FILE,
    METRICS_FILE,
    PLOT_FILE,
    PROFILE_FILE,
    TENSORBOARD_DIR,
    WANDB_DIR,
    CHECKPOINTS,
    LOCK_FILE,
    ERROR_LOG,
)
"""Every name a run directory may hold: what `--overwrite` may replace."""
MODEL_FILE = "model.safetensors"
"""A checkpoint's weights."""
MODEL_CONFIG_KEY = "bdh_config"
"""The key of the model's config (JSON) in model.safetensors' metadata."""
MANIFEST = "manifest.json"
"""SHA-256 and size of every other file of a checkpoint, written last, checked on load."""
EVALS_DIR = "evals"
"""The folder under the working directory where `eval` writes a model's measures by default:
one folder a model (`results_dir`)."""


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a run directory: its config.toml beside its checkpoints, metrics or
    lock (a directory a trainer started in)."""
    return (path / CONFIG_FILE).is_file() and any(
        (path / name).exists() for name in (CHECKPOINTS, METRICS_FILE, LOCK_FILE)
    )


def holds_weights(path: Path) -> bool:
    """Whether `path` is a checkpoint directory: its weights beside its manifest or its run
    config (a checkpoint of bdh-train 0.1 has no manifest)."""
    return (path / MODEL_FILE).is_file() and (
        (path / MANIFEST).is_file() or (path / CONFIG_FILE).is_file()
    )


def guarded_place(path: Path) -> str | None:
    """What `path` (absolute) is or lies inside when no output may be written there, in words
    ('inside the checkpoint X', 'the run directory X', 'X, a file of the run R'); None for a
    place an output may take."""
    for above in (path, *path.parents):
        if holds_weights(above) and not (above / CHECKPOINTS).is_dir():
            return f"the checkpoint {above}" if above == path else f"inside the checkpoint {above}"
        if is_run_dir(above):
            if above == path:
                return f"the run directory {above}"
            first = path.relative_to(above).parts[0]
            if first in LAYOUT:
                part = above / first
                return f"{'inside ' if part != path else ''}{part}, a part of the run {above}"
    return None


def results_dir(checkpoint: str | Path) -> Path:
    """evals/<name>: where `eval` writes the measures of the model at `checkpoint` unless told
    (--out). The name is the run directory's (evals/demo); for a checkpoint inside a run's
    checkpoints/ folder, the run's and the checkpoint's (evals/demo-step-0000300); for a file
    (a ternary export), its name without the suffix. So two models evaluated from one
    working directory never write into each other's folder."""
    path = Path(checkpoint).resolve()
    if path.parent.name == CHECKPOINTS:
        name = f"{path.parent.parent.name}-{path.name}"
    else:
        name = path.stem if path.is_file() else path.name
    return Path(EVALS_DIR) / name
