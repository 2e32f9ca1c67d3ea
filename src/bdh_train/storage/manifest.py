"""A checkpoint's manifest and its verification: manifest.json lists every other file of a
checkpoint directory with its SHA-256 and size (`write_manifest`, written last), and
`verify_checkpoint` checks a directory against it before anything is loaded. A checkpoint
written by v0.1, before manifests existed, is recognised by its files and model config
(`written_by_v0_1`). The checkpoint's JSON files are read bounded (`read_json`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from bdh_train.errors import CheckpointError
from bdh_train.storage.places import CONFIG_FILE, MANIFEST, MODEL_CONFIG_KEY, MODEL_FILE
from bdh_train.utils import atomic_write, read_regular_file

JSON_MAX_BYTES = 16 << 20
"""The most a checkpoint's JSON file (manifest.json, trainer.json, loader.json) may hold: a
manifest takes about 150 bytes a file, the others a few hundred bytes."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_files(directory: Path) -> list[Path]:
    """Every file of a checkpoint directory, its subdirectories' (DCP shards) included."""
    return sorted(p for p in directory.rglob("*") if p.is_file())


def write_manifest(directory: Path) -> None:
    """Write `directory`'s manifest.json: the SHA-256 and size of each of its other files."""
    files = {
        p.relative_to(directory).as_posix(): {"sha256": _sha256(p), "bytes": p.stat().st_size}
        for p in _checkpoint_files(directory)
        if p.name != MANIFEST
    }
    write_json(directory / MANIFEST, {"files": files})


_V0_1_FILES = frozenset(
    {CONFIG_FILE, "loader.json", MODEL_FILE, "optimizer.pt", "ranks.pt", "trainer.json"}
)
"""The files of a checkpoint written by v0.1 (tests/fixtures/checkpoint_v0_1)."""
_V0_1_MODEL_KEYS = frozenset(
    {
        "chunk_size",
        "dropout",
        "executor",
        "language_head",
        "mlp_internal_dim_multiplier",
        "n_embd",
        "n_head",
        "n_layer",
        "norm",
        "position",
        "quant",
        "vocab_size",
    }
)
"""The keys of v0.1's model config (model.safetensors' MODEL_CONFIG_KEY). Every checkpoint written
since summary memory was merged (074993b) has a manifest and model.summary_memory besides."""


def written_by_v0_1(directory: Path) -> bool:
    """Whether `directory` (which has no manifest) is a checkpoint as v0.1 wrote it, before
    manifests existed: exactly v0.1's six files and nothing else (no sharded/, no
    tokenizer.json), and a model config with exactly v0.1's keys, so a checkpoint written
    since summary memory was merged that lost its manifest is not taken for v0.1's. Its files
    cannot be checked: v0.1 recorded no checksums."""
    directory = Path(directory)
    entries = list(directory.iterdir())
    if {p.name for p in entries} != _V0_1_FILES or not all(p.is_file() for p in entries):
        return False
    try:
        with safe_open(str(directory / MODEL_FILE), "pt") as handle:
            config = json.loads((handle.metadata() or {}).get(MODEL_CONFIG_KEY, "null"))
    except (
        SafetensorError,
        ValueError,
        RecursionError,
    ):  # an OSError (unreadable) is not an answer: raised
        return False
    return isinstance(config, dict) and set(config) == _V0_1_MODEL_KEYS


def _listed_files(manifest: Path) -> dict[str, Any]:
    """The manifest's files table: relative path -> {"sha256", "bytes"}."""
    data = read_json(manifest)
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest} lists no files")
    return files


def verify_checkpoint(directory: Path) -> None:
    """Raise CheckpointError unless the checkpoint's manifest is readable and lists exactly the
    files present (model.safetensors among them), each whole and unchanged. A checkpoint
    without a manifest is damaged, unless it is one v0.1 wrote (`written_by_v0_1`)."""
    directory = Path(directory)
    if not (directory / MODEL_FILE).is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MODEL_FILE}")
    if not (directory / MANIFEST).is_file():
        if written_by_v0_1(directory):
            return
        raise CheckpointError(
            f"checkpoint {directory} has no {MANIFEST} and is not one v0.1 wrote (the only "
            "kind without): it is incomplete or was changed"
        )
    files = _listed_files(directory / MANIFEST)
    present = {p.relative_to(directory).as_posix() for p in _checkpoint_files(directory)}
    present.discard(MANIFEST)
    missing = sorted(set(files) - present)
    if missing:
        raise CheckpointError(f"checkpoint {directory} is missing {missing[0]}")
    unlisted = sorted(present - set(files))
    if unlisted:
        raise CheckpointError(
            f"checkpoint {directory}: {', '.join(unlisted)} not listed in its {MANIFEST} (the "
            "checkpoint was changed or the manifest damaged)"
        )
    for name, entry in sorted(files.items()):
        path = directory / name
        if (
            not isinstance(entry, dict)
            or path.stat().st_size != entry.get("bytes")
            or _sha256(path) != entry.get("sha256")
        ):
            raise CheckpointError(
                f"checkpoint {directory}: {name} does not match its SHA-256 in {MANIFEST} "
                "(the file was changed or damaged)"
            )


def write_json(path: Path, data: Any) -> None:
    with atomic_write(path) as handle:
        json.dump(data, handle, indent=1, sort_keys=True)


def read_json(path: Path) -> Any:
    """The JSON in `path`; CheckpointError when it is no regular file of at most
    JSON_MAX_BYTES, cannot be read, is not UTF-8 (a flipped byte) or not JSON."""
    fix = "the checkpoint is damaged: use another checkpoint"
    try:
        data = read_regular_file(path, JSON_MAX_BYTES, str(path), CheckpointError, fix)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # ValueError: UTF-8 and JSON errors
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
