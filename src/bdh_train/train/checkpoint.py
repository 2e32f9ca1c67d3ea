"""Checkpoints: written whole or not at all, kept K deep, found through a `latest` pointer.

A checkpoint is a directory `checkpoints/step-XXXXXXX/`. It is written into a hidden
temporary directory beside it and renamed into place only when every file is on disk, so a
crash (or SIGKILL) during a save leaves the previous checkpoint and pointer untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from bdh_train.errors import CheckpointError
from bdh_train.utils import atomic_write

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"


def checkpoint_name(step: int, micro: int = 0) -> str:
    """step-0000010, or step-0000010-m01 for one taken 1 micro-step into step 11's window."""
    return f"step-{step:07d}" + (f"-m{micro:02d}" if micro else "")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path,
    name: str,
    write: Callable[[Path], None],
    keep: int = 0,
    before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Call `write(tmp_dir)` to fill a fresh directory, then publish it atomically.

    `before_rename` is a test seam: it runs between the complete temporary write and the
    rename, which is where a crash must not damage anything.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    try:
        write(tmp)
        for child in tmp.iterdir():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
        if before_rename is not None:
            before_rename(tmp)
        if final.exists():  # a re-save of the same point (e.g. after resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with atomic_write(root / LATEST) as handle:
        handle.write(final.name + "\n")
    if keep > 0:
        prune_checkpoints(root, keep)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).glob("step-*") if p.is_dir())


def prune_checkpoints(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir (-> its latest checkpoint), a checkpoints/ dir, or a checkpoint dir."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if (path / MODEL_FILE).is_file():
        return path
    for root in (path / CHECKPOINTS, path):
        pointer = root / LATEST
        if pointer.is_file():
            target = root / pointer.read_text().strip()
            if (target / MODEL_FILE).is_file():
                return target
            raise CheckpointError(
                f"{pointer} points to {target.name}, which is missing or incomplete"
            )
    raise CheckpointError(
        f"no checkpoint found at {path}: expected a run directory with "
        f"{CHECKPOINTS}/{LATEST}, or a directory holding {MODEL_FILE}"
    )


# ---------------------------------------------------------------- pieces of a checkpoint
def save_model(model: torch.nn.Module, directory: Path, metadata: dict[str, str]) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / MODEL_FILE), metadata=metadata)


def load_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(Path(directory) / MODEL_FILE))
    except Exception as exc:  # safetensors raises several kinds for a damaged file
        raise CheckpointError(f"cannot read {Path(directory) / MODEL_FILE}: {exc}") from exc


def load_into_model(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Strict load with one message listing every missing, unexpected or mis-shaped key."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    wrong = [
        f"{k}: checkpoint {list(weights[k].shape)} vs model {list(own[k].shape)}"
        for k in sorted(set(own) & set(weights))
        if weights[k].shape != own[k].shape
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if wrong:
            parts.append("mismatched shapes: " + "; ".join(wrong))
        raise CheckpointError(
            f"checkpoint {where} does not fit this model ({', '.join(parts)}); check that "
            "[model] matches the run that wrote it"
        )
    model.load_state_dict(weights)


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_json(path: Path, data: Any) -> None:
    with atomic_write(path) as handle:
        json.dump(data, handle, indent=1, sort_keys=True)


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
