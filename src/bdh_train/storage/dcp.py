"""A sharded (FSDP) run's model and optimizer state as `torch.distributed.checkpoint` (DCP)
shards: every rank writes the pieces it holds; any number of processes, sharded or not, reads
them back. DCP's own reader unpickles its metadata file and the optimizer's non-tensor items;
here the metadata goes through an allow-list unpickler and the items are read weights-only, so
a checkpoint can never run code."""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bdh_train.errors import CheckpointError
from bdh_train.model.bdh import DEFAULTED_KEYS
from bdh_train.utils import first_line, in_process_group


@dataclass
class ShardedState:
    """The model and optimizer state as DCP shards (`torch.distributed.checkpoint`).

    Saving is collective: every rank writes the shards it holds (nothing is gathered on one
    process) and the first writes DCP's metadata. Loading reads, on every rank, the pieces of
    the saved tensors its own parameters cover, whatever the number of processes that wrote
    them: a sharded run's checkpoint resumes on another process count, sharded or not."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def _template(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with _one_process_quietly():
            dcp.save(self._template(), checkpoint_id=str(directory), no_dist=_one_process())

    def load(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._template()
        try:
            _leave_out_defaulted(state, Path(directory))
            _dcp_load(state, Path(directory))
        except dcp_errors() as exc:
            own = _dcp_failure(exc)
            if isinstance(own, CheckpointError):
                raise own from exc
            raise CheckpointError(
                f"cannot read the sharded state {directory}: {first_line(exc)}; check that "
                "[model] matches the run that wrote it, or resume from another checkpoint"
            ) from exc
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


# ------------------------------------------------- DCP's files, read without running their code
DCP_METADATA = ".metadata"
"""DCP's index of a sharded state: a pickled `torch.distributed.checkpoint.metadata.Metadata`."""
_DCP_METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a layout (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib._local", "PosixPath"),  # the same class, as Python 3.13 names it
    }
)
"""The globals DCP's metadata consists of (besides torch's dtypes, `_MetadataUnpickler`)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata building only the classes it consists of: any other global the
    file names (a function to call, a module to import) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        # vars(): a plain lookup, which never triggers torch's lazy submodule imports
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if dtype or (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


def _plain_file_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def read_dcp_metadata(directory: Path) -> Any:
    """The `Metadata` of the DCP state in `directory`, unpickled by `_MetadataUnpickler` (DCP's
    own FileSystemReader uses pickle.load, which runs whatever code the file names), and
    checked to be metadata whose data files are plain file names in `directory`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / DCP_METADATA
    damaged = "it is damaged or was changed: resume from another checkpoint"
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    except Exception as exc:  # pickle's errors, and what an allowed class raises on bad data
        raise CheckpointError(f"cannot read {path} ({first_line(exc)}); {damaged}") from exc
    storage = getattr(metadata, "storage_data", None)
    if not (
        isinstance(metadata, Metadata)
        and isinstance(metadata.state_dict_metadata, dict)
        and isinstance(storage, dict)
        and all(
            isinstance(info, _StorageInfo) and _plain_file_name(info.relative_path)
            for info in storage.values()
        )
    ):
        raise CheckpointError(f"{path} is not DCP metadata of the files beside it; {damaged}")
    return metadata


def _leave_out_defaulted(state: dict[str, Any], directory: Path) -> None:
    """Leave out of the model's template the DEFAULTED_KEYS that `directory` was written
    without (before the model had them): loading the model then fills their values."""
    saved = read_dcp_metadata(directory).state_dict_metadata
    for key in DEFAULTED_KEYS:
        if f"model.{key}" not in saved:
            state["model"].pop(key, None)


def _dcp_load(state: dict[str, Any], directory: Path) -> None:
    """`dcp.load(state)` from `directory`, running no code from its files: the metadata is
    `read_dcp_metadata`'s, and the non-tensor items (the optimizer's param_groups) are
    unpickled by torch's weights-only loader, where DCP's DefaultLoadPlanner.load_bytes uses
    torch.load(weights_only=False). DCP reads tensors weights-only itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    metadata = read_dcp_metadata(directory)

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if metadata.storage_meta is None:  # what FileSystemReader.read_metadata adds
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                item = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(
                    f"cannot read {read_item.dest_index.fqn} of the sharded state {directory} "
                    f"({first_line(exc)}); it is damaged or was changed: resume from another "
                    "checkpoint"
                ) from exc
            copy = io.BytesIO()  # the base class unpickles this copy and stores the item
            torch.save(item, copy)
            copy.seek(0)
            super().load_bytes(read_item, copy)

    with _one_process_quietly():
        dcp.load(state, storage_reader=Reader(directory), planner=Planner(), no_dist=_one_process())


def _dcp_failure(exc: BaseException) -> BaseException:
    """The exception a rank met, out of DCP's CheckpointException (which wraps each rank's as
    (exception, traceback)); any other exception as it is."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return exc


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP save or load raises: DCP wraps what it meets on each rank in a
    CheckpointException, which derives from BaseException, not Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without DCP's UserWarning that it assumes one process, which it gives on every save and
    load without a process group: `_one_process()` told it so (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _one_process() -> bool:
    """No process group: DCP reads and writes every shard itself."""
    return not in_process_group()
