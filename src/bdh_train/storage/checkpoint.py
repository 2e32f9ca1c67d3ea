"""Checkpoints: written whole or not at all, kept K deep, found through a `latest` pointer.

A checkpoint is a directory `checkpoints/step-XXXXXXX/`. It is written into a hidden
temporary directory beside it and published by `output.rename_into_place` (renamed into place
only when every file is on disk), so a crash (or SIGKILL) during a save leaves the previous
checkpoint and pointer untouched. Its manifest and the checks against it are
storage/manifest.py.

`Checkpointer` saves and loads a mapping of stateful parts, one file each; the file's suffix
decides its format (`.json`, `.pt`, `.safetensors` model weights; a part whose state is a
string is written as that text, e.g. config.toml and tokenizer.json). A sharded (FSDP) run
adds `sharded/`: the model and optimizer state in `torch.distributed.checkpoint` (DCP)
format, each rank writing the shards it holds into the shared temporary directory; DCP
reshards on load, so any number of processes (sharded or not) resumes it.
"""

from __future__ import annotations

import errno
import json
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bdh_train import checks
from bdh_train.errors import BDHTrainError, CheckpointError
from bdh_train.model.bdh import shape_mismatch
from bdh_train.storage.dcp import ShardedState, dcp_errors
from bdh_train.storage.manifest import read_json, verify_checkpoint, write_json, write_manifest
from bdh_train.storage.output import make_dir, publish_dir, put_back, rename_into_place
from bdh_train.storage.places import MANIFEST as MANIFEST  # read as ckpt.MANIFEST
from bdh_train.storage.places import MODEL_CONFIG_KEY, MODEL_FILE
from bdh_train.storage.run_dir import CHECKPOINTS
from bdh_train.utils import (
    atomic_write,
    first_line,
    in_process_group,
    quoted,
    read_regular_file,
)


@dataclass
class CheckpointConfig:
    """Where the weights start from. ``resume`` (set by ``--resume``) wins over ``init_from``."""

    init_from: str = ""
    """"" = fresh init; else a run dir, a checkpoint dir, or an official ``.pt`` state_dict."""
    resume: str = ""
    """"" = start a new run; else the run or checkpoint directory to continue exactly."""

    def validate(self, prefix: str = "checkpoint") -> CheckpointConfig:
        checks.string(f"{prefix}.init_from", self.init_from)
        checks.string(f"{prefix}.resume", self.resume)
        return self


LATEST = "latest"
SHARDED_DIR = "sharded"
"""The DCP directory of a sharded run's model and optimizer state."""


LATEST_MAX_BYTES = 256
"""The most a `latest` pointer may hold: one checkpoint name (step-XXXXXXX-mMM) and a newline."""
_NAME = re.compile(r"step-(\d{7,})(?:-m(\d{2,}))?")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_SET_ASIDE = "checkpoint"


def checkpoint_name(step: int, micro: int = 0) -> str:
    """step-0000010, or step-0000010-m01 for one taken 1 micro-step into step 11's window."""
    return f"step-{step:07d}" + (f"-m{micro:02d}" if micro else "")


def checkpoint_position(name: str) -> tuple[int, int] | None:
    """(step, micro) of a checkpoint directory name; None for anything else."""
    match = _NAME.fullmatch(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def recover_checkpoints(root: Path) -> None:
    """Finish or undo what a crash interrupted: a half-written temporary directory is removed;
    a checkpoint set aside for a re-save comes back when its replacement never arrived."""
    root = Path(root)
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(_TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
    for path in root.iterdir():
        if path.name.startswith(_OLD_PREFIX):
            name = path.name[len(_OLD_PREFIX) :].rsplit("-", 1)[0]
            kept = path / _SET_ASIDE
            if kept.is_dir() and checkpoint_position(name):
                put_back(kept, root / name)
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    run_dir: Path,
    name: str,
    write: Callable[[Path], None],
    keep: int = 0,
    before_rename: Callable[[Path], None] | None = None,
    tmp: Path | None = None,
    intact: set[str] | None = None,
) -> Path:
    """Call `write(tmp_dir)` to fill a fresh directory, add its manifest, then publish it.

    The new directory is renamed into place only when every file is on disk
    (`output.rename_into_place`); a checkpoint of the same name is first set aside inside
    checkpoints/ and deleted only after the new one is in place and `latest` names it, so a
    crash at any point leaves one whole checkpoint of that name (`recover_checkpoints`).
    `before_rename` is a test seam: it runs between the complete temporary write and the
    rename, which is where a crash must not damage anything. `tmp` is a temporary directory
    from `make_temp_dir` that other processes have already written into (DCP shards).
    `intact`: the names of checkpoints known intact, for pruning (`prune_checkpoints`); the
    new one is added.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / name
    building = make_temp_dir(run_dir, name) if tmp is None else tmp
    try:
        write(building)
        write_manifest(building)
        old = rename_into_place(  # a re-save of the same point (e.g. after resume): swapped
            building,
            final,
            lambda: make_dir(root, f"{_OLD_PREFIX}{final.name}-") / _SET_ASIDE,
            None if before_rename is None else lambda: before_rename(building),
        )
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    with atomic_write(root / LATEST) as handle:
        handle.write(final.name + "\n")
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)
    if intact is not None:
        intact.add(final.name)
    if keep > 0:
        prune_checkpoints(root, keep, intact)
    return final


def publish_checkpoint_dir(final: Path, write: Callable[[Path], None], command: str) -> Path:
    """A checkpoint directory `final` outside any run (`resolve_checkpoint` reads it), written
    whole or not at all by the output policy's `publish_dir` (--out: never an existing path,
    never inside a checkpoint or a run's files): `write` fills a temporary directory beside
    it, the manifest is added, and the directory is renamed into place. What a killed
    `command` left for `final` is removed first."""

    def sealed(directory: Path) -> None:
        write(directory)
        write_manifest(directory)

    return publish_dir(final, sealed, "--out", command, CheckpointError)


def make_temp_dir(run_dir: Path, name: str) -> Path:
    """The hidden temporary directory checkpoint `name` is written into before its rename."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    return make_dir(root, f"{_TMP_PREFIX}{name}-")


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories, oldest first by (step, micro-step) — not by name."""
    found = [p for p in Path(root).iterdir() if p.is_dir() and checkpoint_position(p.name)]
    return sorted(found, key=lambda p: checkpoint_position(p.name) or (0, 0))


def prune_checkpoints(root: Path, keep: int, intact: set[str] | None = None) -> None:
    """Keep the newest `keep` intact checkpoints by step and delete the others, damaged ones
    included: only intact checkpoints count toward `keep`, so a damaged one (e.g. the newest,
    abandoned by --resume-fallback) never stays while an intact one goes. A checkpoint whose
    files cannot be read (an OSError) is left alone and not counted. The one `latest` names
    (the one just written, or an older one a user pointed it back to) is never deleted. A
    `keep` of 0 keeps all.

    `intact`: names of checkpoints known intact (written or verified by this process), which
    are not read again; those verified here are added."""
    if keep <= 0:
        return
    root = Path(root)
    known = intact if intact is not None else set()
    pointer = root / LATEST
    try:
        protected = _pointer_name(pointer) if pointer.is_file() else None
    except (OSError, CheckpointError):
        protected = None
    kept = 0
    for checkpoint in reversed(list_checkpoints(root)):
        whole = _intact(checkpoint, known) if kept < keep else False
        if whole:
            kept += 1
        elif whole is False and checkpoint.name != protected:
            shutil.rmtree(checkpoint, ignore_errors=True)


def _intact(checkpoint: Path, known: set[str]) -> bool | None:
    """Whether `checkpoint` verifies (`verify_checkpoint`); None when a file of it cannot be
    read (an OSError, which read_json turns into a CheckpointError for the manifest)."""
    if checkpoint.name in known:
        return True
    try:
        verify_checkpoint(checkpoint)
    except CheckpointError as exc:
        return None if isinstance(exc.__cause__, OSError) else False
    except OSError:
        return None
    known.add(checkpoint.name)
    return True


def _pointer_name(pointer: Path) -> str:
    """The checkpoint name a `latest` pointer holds, read as a regular file of at most
    LATEST_MAX_BYTES (CheckpointError otherwise); not checked to be a checkpoint's name."""
    fix = "write the name of a checkpoint directory into it (step-XXXXXXX), or delete it"
    data = read_regular_file(pointer, LATEST_MAX_BYTES, str(pointer), CheckpointError, fix)
    return data.decode(errors="replace").strip()


def _read_pointer(root: Path) -> Path:
    pointer = root / LATEST
    try:
        name = _pointer_name(pointer)
    except OSError as exc:
        raise CheckpointError(f"cannot read {pointer}: {exc}") from exc
    if checkpoint_position(name) is None:
        raise CheckpointError(
            f"{pointer} holds {quoted(name)}, not the name of a checkpoint directory inside "
            f"{root} (step-XXXXXXX)"
        )
    return root / name


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is one checkpoint's directory (it holds the weights), not a run's."""
    return (path / MODEL_FILE).is_file() and not (path / CHECKPOINTS).is_dir()


def resolve_checkpoint(path: str | Path, fallback: bool = False) -> Path:
    """A run dir (-> its latest checkpoint), a checkpoints/ dir, or a checkpoint dir; verified
    against its manifest. Without a `latest` pointer the newest checkpoint by step is the
    latest. When the latest is damaged, or `latest` is unreadable or names no checkpoint, the
    error names the newest intact checkpoint; with `fallback` that one is returned instead."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if (path / MODEL_FILE).is_file():
        verify_checkpoint(path)
        return path
    for root in (path / CHECKPOINTS, path):
        pointer = (root / LATEST).is_file()
        found = list_checkpoints(root) if root.is_dir() else []
        if not pointer and not found:
            continue
        try:
            target = _read_pointer(root) if pointer else found[-1]
            if not target.is_dir():
                raise CheckpointError(f"{root / LATEST} points to {target.name}, which is missing")
            verify_checkpoint(target)
            return target
        except CheckpointError as exc:
            intact = newest_intact_checkpoint(root)
            if fallback and intact is not None:
                return intact
            offer = (
                f"; the newest intact checkpoint is {intact} (resume from it with "
                "--resume-fallback; generate, eval and export read it as --checkpoint)"
                if intact is not None
                else "; no intact checkpoint is left"
            )
            raise CheckpointError(f"{exc}{offer}") from None
    raise CheckpointError(
        f"no checkpoint found at {path}: expected a run directory with "
        f"{CHECKPOINTS}/{LATEST}, or a directory holding {MODEL_FILE}"
    )


def newest_intact_checkpoint(root: Path) -> Path | None:
    for candidate in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


# ---------------------------------------------------------------- pieces of a checkpoint
def load_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(Path(directory) / MODEL_FILE))
    except Exception as exc:  # safetensors raises several kinds for a damaged file
        raise CheckpointError(
            f"cannot read {Path(directory) / MODEL_FILE}: {first_line(exc)}"
        ) from exc


def load_into_model(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Strict load with one message listing every missing, unexpected or mis-shaped key (a
    key of DEFAULTED_KEYS may be missing: the model fills it)."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = shape_mismatch(own, {k: tuple(v.shape) for k, v in weights.items()})
    if problems is not None:
        raise CheckpointError(
            f"checkpoint {where} does not fit this model ({problems}); check that "
            "[model] matches the run that wrote it"
        )
    model.load_state_dict(weights)


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a checkpoint's model.safetensors, from its header
    alone (no tensor is read)."""
    path = Path(directory) / MODEL_FILE
    try:
        with safe_open(str(path), "pt") as handle:
            return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises several kinds for a damaged file
        raise CheckpointError(f"cannot read {path}: {first_line(exc)}") from exc


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the legacy form: (name, keys, pos, has_gauss, gauss)
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


def torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read {path} ({first_line(exc)}); the file is damaged: resume from "
            "another checkpoint"
        ) from exc


FULL_DISK_BYTES = 1 << 16
"""Free bytes below which a failed write whose error names no OS error is reported as a full
disk: torch's zip writer reports a short write as 'unexpected pos A vs B'."""


def write_failure(directory: Path, exc: BaseException) -> str:
    """Why a write on the disk holding `directory` failed, for one error line: the error's
    first line, led by 'No space left on device' when it carries no OS error number and that
    disk has less than FULL_DISK_BYTES free."""
    reason = first_line(exc)
    if isinstance(exc, OSError) and exc.errno is not None:
        return reason
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return reason
    if free >= FULL_DISK_BYTES:
        return reason
    return f"No space left on device: {free:,} bytes free; {reason}"


class CheckpointWriteError(BDHTrainError):
    """A checkpoint file could not be written (disk full, file size limit, read-only
    directory); the half-written checkpoint is removed and the previous one is intact. The
    reason is `write_failure`'s, on the disk holding the run directory."""

    def __init__(self, run_dir: Path, path: Path, exc: BaseException) -> None:
        why = write_failure(run_dir, exc)
        super().__init__(f"cannot write {path} ({why}); {io_advice(run_dir)}")


PATH_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP})
"""OS errors of a path that cannot be the run directory (a part of it is a file, a name too
long, links in a loop), which no room fixes (`io_advice`)."""


def io_advice(run_dir: Path, exc: BaseException | None = None) -> str:
    """What to do after a write failed in `run_dir` (with `exc`, the OSError, when known):
    where the last good checkpoint is and how to continue from it; for a PATH_ERRNOS error,
    that the run directory's path cannot be used."""
    if isinstance(exc, OSError) and exc.errno in PATH_ERRNOS:
        return (
            f"the run directory {run_dir} cannot be made or written there: give --run-dir a "
            "path inside a directory you can write"
        )
    fix = "free space (or raise the file size limit, or make the directory writable)"
    try:
        last = resolve_checkpoint(run_dir)
    except CheckpointError:
        return f"no checkpoint was written: {fix}, then start again"
    return (
        f"the last checkpoint, {last}, is intact: {fix}, then continue with: "
        f"bdh-train train --resume {run_dir}"
    )


# ---------------------------------------------------------------- a mapping of stateful parts
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def weights_metadata(model_config: dict[str, Any], step: int) -> dict[str, str]:
    """model.safetensors' metadata: the model's config as JSON (`MODEL_CONFIG_KEY`, which
    `load_run` builds the model from) and the step it was taken at."""
    return {MODEL_CONFIG_KEY: json.dumps(model_config), "step": str(step)}


@dataclass
class ModelWeights:
    """The model as a checkpoint part: its tensors plus string metadata in safetensors."""

    model: torch.nn.Module
    metadata: Callable[[], dict[str, str]]
    tensors: Callable[[], dict[str, torch.Tensor]] | None = None
    """The whole tensors on the main process (a sharded model gathers them); default: the
    model's state_dict."""

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        source = self.tensors() if self.tensors is not None else self.model.state_dict()
        tensors = {k: v.detach().contiguous().cpu() for k, v in source.items()}
        return tensors, self.metadata()

    def load_state_dict(self, state: tuple[dict[str, torch.Tensor], Path]) -> None:
        weights, where = state
        load_into_model(self.model, weights, where)


def _write_part(path: Path, state: Any) -> None:
    if isinstance(state, str):  # a part that is its own file's text (config, tokenizer)
        path.write_text(state, encoding="utf-8")
    elif path.suffix == ".json":
        write_json(path, state)
    elif path.suffix == ".pt":
        with path.open("wb") as f:  # closed when the write fails, not when the error is freed
            torch.save(state, f)
    elif path.suffix == ".safetensors":
        tensors, metadata = state
        save_file(tensors, str(path), metadata=metadata)  # its mode: `rename_into_place`
    else:
        raise ValueError(f"no checkpoint format for {path.name}")


def _read_part(path: Path) -> Any:
    if path.suffix == ".json":
        return read_json(path)
    if path.suffix == ".pt":
        return torch_load(path)
    if path.suffix == ".safetensors":
        return load_model_weights(path.parent), path.parent
    raise ValueError(f"no checkpoint format for {path.name}")


class Checkpointer:
    """Saves and loads a run's stateful parts as one atomic checkpoint directory.

    `save` asks every part for its state on every process (a part may gather across ranks),
    and only the main process writes them. A `ShardedState` is written by every process into
    the checkpoint's `sharded/` before the main process writes the rest, the manifest, and
    renames. `load` reads the parts in mapping order, so a part that refuses the checkpoint
    (e.g. the trainer state's world size) is checked before the others; the sharded state
    comes last.
    """

    def __init__(self, run_dir: str | Path, keep: int = 0, is_main: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.is_main = is_main
        self.intact: set[str] = set()
        """Names of this run's checkpoints this process wrote or verified (for pruning)."""
        if is_main:
            recover_checkpoints(self.run_dir / CHECKPOINTS)

    def save(
        self,
        name: str,
        parts: Mapping[str, Stateful],
        before_rename: Callable[[Path], None] | None = None,
        sharded: ShardedState | None = None,
    ) -> Path | None:
        states = {file: part.state_dict() for file, part in parts.items()}
        tmp = None
        if sharded is not None:
            tmp = self._shared_temp_dir(name)
            try:
                sharded.save(tmp / SHARDED_DIR)
            except dcp_errors() as exc:  # DCP raises on every rank when any rank failed
                if self.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                where = self.run_dir / CHECKPOINTS / name / SHARDED_DIR
                raise CheckpointWriteError(self.run_dir, where, exc) from exc
        if not self.is_main:
            return None

        def write(directory: Path) -> None:
            for file, state in states.items():
                try:
                    _write_part(directory / file, state)
                except Exception as exc:  # torch and safetensors wrap the OSError they meet
                    where = self.run_dir / CHECKPOINTS / name / file
                    raise CheckpointWriteError(self.run_dir, where, exc) from exc

        return save_checkpoint(
            self.run_dir, name, write, self.keep, before_rename, tmp, self.intact
        )

    def _shared_temp_dir(self, name: str) -> Path:
        """The main process makes the temporary directory and tells the others its path."""
        import torch.distributed as dist

        made: list[Any] = [None]
        if self.is_main:
            try:
                made[0] = make_temp_dir(self.run_dir, name)
            except OSError as exc:
                made[0] = exc
        if in_process_group():
            dist.broadcast_object_list(made, src=0)
        if isinstance(made[0], BaseException):
            raise CheckpointWriteError(self.run_dir, self.run_dir / CHECKPOINTS, made[0])
        return Path(made[0])

    def load(
        self,
        directory: Path,
        parts: Mapping[str, Stateful],
        sharded: ShardedState | None = None,
    ) -> None:
        verify_checkpoint(directory)
        if Path(directory).parent == self.run_dir / CHECKPOINTS:
            self.intact.add(Path(directory).name)
        for file, part in parts.items():
            state = _read_part(directory / file)
            try:
                part.load_state_dict(state)
            except BDHTrainError:
                raise
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise CheckpointError(
                    f"checkpoint {directory} does not fit this run ({file}): {exc}"
                ) from exc
        if sharded is not None:
            sharded.load(directory / SHARDED_DIR)
