"""What a checkpoint may be trusted with: nothing in one runs code (DCP's metadata and
non-tensor items, optimizer.pt, ranks.pt), a manifest that is missing, unreadable or does not
cover every file makes it damaged (except v0.1's, written before manifests), a missing
`latest` is the newest checkpoint, pruning counts only intact checkpoints, and every file
follows the umask."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from helpers import MICRO_RUN, set_args
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bdh_train.cli import main
from bdh_train.errors import CheckpointError
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage import dcp
from bdh_train.storage import manifest as ckpt_manifest

SETS = set_args(
    [
        *MICRO_RUN,
        "training.eval_every=0",
        "training.checkpoint_every=2",
        "training.keep_checkpoints=0",
        "training.max_steps=4",
    ]
)
FIXTURE_V0_1 = Path(__file__).parents[1] / "fixtures" / "checkpoint_v0_1"
V0_1_CHECKPOINT = FIXTURE_V0_1 / "checkpoints" / "step-0000004-m01"


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def copy_run(base: Path, where: Path) -> Path:
    shutil.copytree(base, where)
    (where / ".lock").unlink(missing_ok=True)
    return where


def flip_byte(path: Path, at: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished four-step run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("plain") / "run"
    assert main(["train", "--run-dir", str(run), *SETS]) == 0
    return run


# ---------------------------------------------------------------- nothing in a checkpoint runs
@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run of one process with parallel.shard = 'fsdp' (DCP's layout)."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    sets = [*SETS, "--set", "training.max_steps=2", "--set", "parallel.shard=fsdp"]
    sets += ["--set", "optimizer.name=adamw"]  # Muon, the preset's, refuses fsdp
    assert main(["train", "--run-dir", str(run), *sets]) == 0
    return run


class _Payload:
    """Unpickling it calls open(marker, 'w'): the marker file is proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _poison_metadata(sharded: Path, marker: Path, inside: bool) -> None:
    """.metadata as the payload itself, or as the real metadata carrying it."""
    if inside:
        metadata = pickle.loads((sharded / dcp.DCP_METADATA).read_bytes())  # written here
        metadata.planner_data["extra"] = _Payload(marker)
        (sharded / dcp.DCP_METADATA).write_bytes(pickle.dumps(metadata))
    else:
        (sharded / dcp.DCP_METADATA).write_bytes(pickle.dumps(_Payload(marker)))


def _poison_byte_item(sharded: Path, marker: Path) -> None:
    """The optimizer's lr (a non-tensor item DCP stores pickled) replaced by the payload: the
    payload appended to the data file and the metadata pointed at it."""
    metadata = pickle.loads((sharded / dcp.DCP_METADATA).read_bytes())  # written here
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[key]
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)
    data = sharded / info.relative_path
    info.offset, info.length = data.stat().st_size, len(buffer.getvalue())
    with open(data, "ab") as handle:
        handle.write(buffer.getvalue())
    (sharded / dcp.DCP_METADATA).write_bytes(pickle.dumps(metadata))


def _poison_torch_file(checkpoint: Path, name: str, marker: Path) -> None:
    torch.save({"state": {}, "param_groups": [_Payload(marker)]}, checkpoint / name)


@pytest.mark.parametrize(
    "where, expected",
    [
        ("metadata", "sharded/.metadata (it names io.open, which DCP metadata never holds); "),
        ("metadata-inside", "sharded/.metadata (it names io.open, which DCP metadata never "),
        ("byte-item", "cannot read optimizer.param_groups.0.lr of the sharded state "),
        ("optimizer.pt", "optimizer.pt (Weights only load failed."),
        ("ranks.pt", "ranks.pt (Weights only load failed."),
    ],
    ids=["metadata", "metadata-inside", "byte-item", "optimizer.pt", "ranks.pt"],
)
def test_a_payload_in_any_checkpoint_file_runs_nothing_on_resume(
    plain_run: Path,
    sharded_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    where: str,
    expected: str,
) -> None:
    """A pickle payload that would create a file, in each file a resume unpickles, with the
    manifest re-signed (so the checksums pass): the resume refuses it in one error line and
    the file is never created. model.safetensors and the JSON files hold no code."""
    marker = tmp_path / "ran"
    sharded = where in ("metadata", "metadata-inside", "byte-item")
    run = copy_run(sharded_run if sharded else plain_run, tmp_path / "run")
    checkpoint = ckpt.resolve_checkpoint(run)
    if where.startswith("metadata"):
        _poison_metadata(checkpoint / ckpt.SHARDED_DIR, marker, where == "metadata-inside")
    elif where == "byte-item":
        _poison_byte_item(checkpoint / ckpt.SHARDED_DIR, marker)
    else:
        _poison_torch_file(checkpoint, where, marker)
    ckpt.write_manifest(checkpoint)
    ckpt.verify_checkpoint(checkpoint)
    capsys.readouterr()
    status = main(["train", "--resume", str(run), "--set", "training.max_steps=5"])
    assert not marker.exists()
    assert status == 2
    line = one_error_line(capsys)
    assert expected in line and str(checkpoint) in line, line
    assert line.endswith("resume from another checkpoint"), line


def test_the_metadata_unpickler_takes_only_dcp_metadata(sharded_run: Path, tmp_path: Path) -> None:
    """The real metadata reads back equal to what pickle reads; one that is not metadata, or
    whose data files are not plain names beside it, is refused; an unreadable one is named."""
    sharded = ckpt.resolve_checkpoint(sharded_run) / ckpt.SHARDED_DIR
    metadata = dcp.read_dcp_metadata(sharded)
    assert metadata == pickle.loads((sharded / dcp.DCP_METADATA).read_bytes())
    assert {info.relative_path for info in metadata.storage_data.values()} == {"__0_0.distcp"}
    copy = tmp_path / "sharded"
    shutil.copytree(sharded, copy)
    refused = (
        f"{copy / '.metadata'} is not DCP metadata of the files beside it; it is damaged or was "
        "changed: resume from another checkpoint"
    )
    for name in ("../__0_0.distcp", "sub/__0_0.distcp", "..", ""):
        for info in metadata.storage_data.values():
            info.relative_path = name
        (copy / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(CheckpointError) as err:
            dcp.read_dcp_metadata(copy)
        assert str(err.value) == refused
    (copy / ".metadata").write_bytes(pickle.dumps({"storage_data": {}}))
    with pytest.raises(CheckpointError) as err:
        dcp.read_dcp_metadata(copy)
    assert str(err.value) == refused
    (copy / ".metadata").write_bytes(pickle.dumps(torch.float16))  # an allowed class alone
    with pytest.raises(CheckpointError) as err:
        dcp.read_dcp_metadata(copy)
    assert str(err.value) == refused
    for other in (os.system, torch.load, shutil.rmtree):
        (copy / ".metadata").write_bytes(pickle.dumps(other))
        with pytest.raises(CheckpointError) as err:
            dcp.read_dcp_metadata(copy)
        name = f"{other.__module__}.{other.__qualname__}"
        assert f"(it names {name}, which DCP metadata never holds)" in str(err.value)
    (copy / ".metadata").write_bytes(b"\x80\x04truncated")
    with pytest.raises(CheckpointError, match=r"\.metadata \(.*\); it is damaged or was changed"):
        dcp.read_dcp_metadata(copy)
    (copy / ".metadata").unlink()
    with pytest.raises(CheckpointError) as err:
        dcp.read_dcp_metadata(copy)
    assert str(err.value).startswith(f"cannot read {copy / '.metadata'}: [Errno 2] ")


# ---------------------------------------------------------------- a checkpoint has a manifest
def test_a_damaged_manifest_is_a_damaged_checkpoint_everywhere(
    plain_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One flipped byte makes manifest.json invalid UTF-8: train --resume and eval say so in
    one line, naming the newest intact checkpoint, and --resume-fallback resumes from it."""
    run = copy_run(plain_run, tmp_path / "run")
    root = run / "checkpoints"
    manifest = root / "step-0000004" / ckpt.MANIFEST
    flip_byte(manifest, 0)  # '{' -> 0x84: not UTF-8
    assert ckpt.newest_intact_checkpoint(root) == root / "step-0000002"
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=5"]) == 2
    line = one_error_line(capsys)
    assert line == (
        f"error: cannot read {manifest}: 'utf-8' codec can't decode byte 0x84 in position 0: "
        f"invalid start byte; the newest intact checkpoint is {root / 'step-0000002'} (resume "
        "from it with --resume-fallback; generate, eval and export read it as --checkpoint)"
    )
    assert main(["eval", "--checkpoint", str(run), "--batches", "1"]) == 2
    assert one_error_line(capsys) == line
    assert main(["eval", "--checkpoint", str(root / "step-0000004"), "--batches", "1"]) == 2
    assert one_error_line(capsys) == line.split("; the newest")[0]
    fallback = ["--resume", str(run), "--resume-fallback", "--set", "training.max_steps=3"]
    assert main(["train", *fallback]) == 0
    assert f"resumed from {root / 'step-0000002'}" in capsys.readouterr().out


def test_a_checkpoint_without_its_manifest_is_not_used(
    plain_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flipped weights in a checkpoint whose manifest was deleted, or emptied: generate, eval
    and train --resume refuse it."""
    run = copy_run(plain_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step-0000004"
    weights = load_file(str(checkpoint / ckpt.MODEL_FILE))
    with safe_open(str(checkpoint / ckpt.MODEL_FILE), "pt") as handle:
        metadata = handle.metadata()
    save_file({k: -v for k, v in weights.items()}, str(checkpoint / ckpt.MODEL_FILE), metadata)
    capsys.readouterr()
    (checkpoint / ckpt.MANIFEST).unlink()
    missing = (
        f"error: checkpoint {checkpoint} has no manifest.json and is not one v0.1 wrote (the "
        "only kind without): it is incomplete or was changed"
    )
    greedy = ["--temperature", "0", "--max-new-tokens", "2", "--device", "cpu"]
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "a", *greedy]) == 2
    assert one_error_line(capsys) == missing
    assert main(["eval", "--checkpoint", str(run), "--batches", "1"]) == 2
    assert one_error_line(capsys).startswith(missing + "; the newest intact checkpoint is ")
    (checkpoint / ckpt.MANIFEST).write_text(json.dumps({"files": {}}))
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=5"]) == 2
    assert one_error_line(capsys).startswith(
        f"error: checkpoint {checkpoint}: config.toml, loader.json, model.safetensors, "
        "optimizer.pt, ranks.pt, trainer.json not listed in its manifest.json (the checkpoint "
        "was changed or the manifest damaged); the newest intact checkpoint is "
    )


def _verified(directory: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        ckpt.verify_checkpoint(directory)
    return str(err.value)


def test_the_manifest_must_cover_exactly_the_files_present(tmp_path: Path) -> None:
    def write(directory: Path) -> None:
        (directory / ckpt.MODEL_FILE).write_bytes(b"m")
        (directory / "sub").mkdir()
        (directory / "sub" / "shard").write_bytes(b"s")

    checkpoint = ckpt.save_checkpoint(tmp_path, "step-0000001", write)
    manifest = checkpoint / ckpt.MANIFEST
    listed = json.loads(manifest.read_text())
    (checkpoint / "sub" / "extra").write_bytes(b"")
    assert _verified(checkpoint) == (
        f"checkpoint {checkpoint}: sub/extra not listed in its manifest.json (the checkpoint was "
        "changed or the manifest damaged)"
    )
    (checkpoint / "sub" / "extra").unlink()
    ckpt.verify_checkpoint(checkpoint)
    del listed["files"][ckpt.MODEL_FILE]
    manifest.write_text(json.dumps(listed))
    assert _verified(checkpoint).startswith(f"checkpoint {checkpoint}: model.safetensors not ")
    outside = tmp_path / "outside"
    outside.write_bytes(b"o")
    base = json.loads(manifest.read_text())["files"]
    for name, entry in (("../../outside", "x"), ("/etc/hostname", {"bytes": 1})):
        files = {**base, name: entry}
        manifest.write_text(json.dumps({"files": files}))
        assert _verified(checkpoint) == f"checkpoint {checkpoint} is missing {name}"
    whole = ckpt_manifest._sha256(checkpoint / ckpt.MODEL_FILE)
    for entry in (["not", "a", "table"], None, {"sha256": whole}, {"bytes": 1}):
        files = {
            ckpt.MODEL_FILE: entry,
            "sub/shard": {
                "bytes": 1,
                "sha256": ckpt_manifest._sha256(checkpoint / "sub" / "shard"),
            },
        }
        manifest.write_text(json.dumps({"files": files}))
        assert _verified(checkpoint) == (
            f"checkpoint {checkpoint}: model.safetensors does not match its SHA-256 in "
            "manifest.json (the file was changed or damaged)"
        )
    manifest.write_bytes(b'{"files": {\xff}}')
    assert _verified(checkpoint).startswith(f"cannot read {manifest}: 'utf-8' codec can't")
    manifest.write_text("[" * 100_000)
    assert _verified(checkpoint).startswith(f"cannot read {manifest}: ")


def test_v0_1s_checkpoint_is_the_one_kind_without_a_manifest(tmp_path: Path) -> None:
    """v0.1's checkpoint (no manifest) is recognised by exactly its six files and its model
    config's keys; the same directory with anything added, removed or changed is not."""
    assert ckpt_manifest.written_by_v0_1(V0_1_CHECKPOINT)
    ckpt.verify_checkpoint(V0_1_CHECKPOINT)
    assert ckpt.resolve_checkpoint(FIXTURE_V0_1) == V0_1_CHECKPOINT

    def variant(name: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(V0_1_CHECKPOINT, copy)
        return copy

    (variant("tokenizer") / "tokenizer.json").write_text("{}")
    (variant("sharded") / ckpt.SHARDED_DIR).mkdir()
    (variant("no-ranks") / "ranks.pt").unlink()
    no_pt = variant("ranks-dir")
    (no_pt / "ranks.pt").unlink()
    (no_pt / "ranks.pt").mkdir()
    newer = variant("summary-memory")  # a later model config whose manifest was removed
    with safe_open(str(newer / ckpt.MODEL_FILE), "pt") as handle:
        metadata = handle.metadata()
    config = json.loads(metadata["bdh_config"])
    config["summary_memory"] = {"enabled": False}
    tensors = load_file(str(newer / ckpt.MODEL_FILE))
    save_file(tensors, str(newer / ckpt.MODEL_FILE), {**metadata, "bdh_config": json.dumps(config)})
    no_config = variant("no-config")
    save_file(tensors, str(no_config / ckpt.MODEL_FILE), {"step": "4"})
    flip_byte(variant("damaged-header") / ckpt.MODEL_FILE, 0)
    names = (
        "tokenizer",
        "sharded",
        "no-ranks",
        "ranks-dir",
        "summary-memory",
        "no-config",
        "damaged-header",
    )
    for name in names:
        assert not ckpt_manifest.written_by_v0_1(tmp_path / name), name
        assert "has no manifest.json and is not one v0.1 wrote" in _verified(tmp_path / name)
    flipped = variant("flipped-weights")  # v0.1 recorded no checksum: this cannot be seen
    flip_byte(flipped / ckpt.MODEL_FILE)
    assert ckpt_manifest.written_by_v0_1(flipped)


# ---------------------------------------------------------------- a missing `latest`
def test_a_missing_latest_resolves_to_the_newest_checkpoint(
    plain_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without checkpoints/latest, train --resume and eval take the newest checkpoint; when
    that one is damaged, the error names the newest intact one and --resume-fallback takes
    it, as when `latest` names a damaged one."""
    run = copy_run(plain_run, tmp_path / "run")
    root = run / "checkpoints"
    (root / ckpt.LATEST).unlink()
    for path in (run, root):
        assert ckpt.resolve_checkpoint(path) == root / "step-0000004"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--batches", "1"]) == 0
    damaged = copy_run(run, tmp_path / "damaged")
    assert main(["train", "--resume", str(run), "--set", "training.max_steps=5"]) == 0
    assert f"resumed from {root / 'step-0000004'}" in capsys.readouterr().out
    assert (root / ckpt.LATEST).read_text() == "step-0000005\n"

    root = damaged / "checkpoints"
    flip_byte(root / "step-0000004" / ckpt.MODEL_FILE)
    assert main(["train", "--resume", str(damaged), "--set", "training.max_steps=5"]) == 2
    assert one_error_line(capsys) == (
        f"error: checkpoint {root / 'step-0000004'}: model.safetensors does not match its "
        f"SHA-256 in manifest.json (the file was changed or damaged); the newest intact "
        f"checkpoint is {root / 'step-0000002'} (resume from it with --resume-fallback; "
        "generate, eval and export read it as --checkpoint)"
    )
    assert ckpt.resolve_checkpoint(damaged, fallback=True) == root / "step-0000002"
    shutil.rmtree(root / "step-0000002")
    shutil.rmtree(root / "step-0000004")
    with pytest.raises(CheckpointError, match="no checkpoint found at"):
        ckpt.resolve_checkpoint(damaged)


def test_an_unreadable_latest_is_a_damaged_pointer(tmp_path: Path) -> None:
    def write(directory: Path) -> None:
        (directory / ckpt.MODEL_FILE).write_bytes(b"m")

    first = ckpt.save_checkpoint(tmp_path, "step-0000001", write)
    pointer = tmp_path / "checkpoints" / ckpt.LATEST
    read = ckpt.read_regular_file

    def refusing(path: Path, *args: Any, **kwargs: Any) -> bytes:
        if path == pointer:
            raise PermissionError(13, "Permission denied")
        return read(path, *args, **kwargs)

    with (
        mock.patch.object(ckpt, "read_regular_file", refusing),
        pytest.raises(CheckpointError) as err,
    ):
        ckpt.resolve_checkpoint(tmp_path)
    assert str(err.value) == (
        f"cannot read {pointer}: [Errno 13] Permission denied; the newest intact checkpoint is "
        f"{first} (resume from it with --resume-fallback; generate, eval and export read it as "
        "--checkpoint)"
    )


# ---------------------------------------------------------------- pruning counts intact ones
def _save(run: Path, step: int, keep: int = 0, intact: set[str] | None = None) -> Path:
    def write(directory: Path) -> None:
        (directory / ckpt.MODEL_FILE).write_bytes(str(step).encode())

    return ckpt.save_checkpoint(run, ckpt.checkpoint_name(step), write, keep, intact=intact)


def _names(run: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(run / ckpt.CHECKPOINTS)]


def test_pruning_counts_only_intact_checkpoints_and_deletes_damaged_ones(tmp_path: Path) -> None:
    """Checkpoints 2, 4, 6 with 6 damaged (abandoned by --resume-fallback from 4): the save of
    5 with keep 2 keeps 4 and 5 and deletes 6 and 2; with keep 3 it keeps 2, 4 and 5."""
    for keep, kept in ((2, [4, 5]), (3, [2, 4, 5])):
        run = tmp_path / f"keep{keep}"
        for step in (2, 4, 6):
            _save(run, step)
        flip_byte(run / "checkpoints" / "step-0000006" / ckpt.MODEL_FILE)
        _save(run, 5, keep=keep)
        assert _names(run) == [ckpt.checkpoint_name(step) for step in kept]
    run = tmp_path / "latest-damaged"  # `latest` names a damaged one: it stays, uncounted
    for step in (1, 2, 3):
        _save(run, step)
    flip_byte(run / "checkpoints" / "step-0000003" / ckpt.MODEL_FILE)
    ckpt.prune_checkpoints(run / "checkpoints", keep=0)  # keeps all
    assert _names(run) == ["step-0000001", "step-0000002", "step-0000003"]
    ckpt.prune_checkpoints(run / "checkpoints", keep=1)
    assert _names(run) == ["step-0000002", "step-0000003"]


def test_pruning_leaves_a_checkpoint_it_cannot_read_and_reads_each_once(tmp_path: Path) -> None:
    """A checkpoint with a file that cannot be read (an I/O error on the weights or on the
    manifest) is neither counted nor deleted; once readable it is counted. A Checkpointer's
    own checkpoints are never read again."""
    for step in (1, 2, 3):
        _save(tmp_path, step)
    second = tmp_path / "checkpoints" / "step-0000002"
    sha256, read = ckpt_manifest._sha256, ckpt_manifest.read_regular_file

    def failing_sha256(path: Path) -> str:
        if path == second / ckpt.MODEL_FILE:
            raise OSError(5, "Input/output error")
        return sha256(path)

    def failing_read(path: Path, *args: Any, **kwargs: Any) -> bytes:
        if path == second / ckpt.MANIFEST:
            raise OSError(5, "Input/output error")
        return read(path, *args, **kwargs)

    for patch in (
        mock.patch.object(ckpt_manifest, "_sha256", failing_sha256),
        mock.patch.object(ckpt_manifest, "read_regular_file", failing_read),
    ):
        with patch:
            ckpt.prune_checkpoints(tmp_path / "checkpoints", keep=2)
        assert _names(tmp_path) == ["step-0000001", "step-0000002", "step-0000003"]
    ckpt.prune_checkpoints(tmp_path / "checkpoints", keep=2)
    assert _names(tmp_path) == ["step-0000002", "step-0000003"]
    verified: list[str] = []
    verify = ckpt.verify_checkpoint

    def counting(directory: Path) -> None:
        verified.append(Path(directory).name)
        verify(directory)

    intact: set[str] = set()
    with mock.patch.object(ckpt, "verify_checkpoint", counting):
        for step in (4, 5, 6):
            _save(tmp_path, step, keep=3, intact=intact)
    assert verified == ["step-0000003", "step-0000002"]  # the ones written here are known
    assert _names(tmp_path) == ["step-0000004", "step-0000005", "step-0000006"]
    assert intact == {f"step-000000{n}" for n in (2, 3, 4, 5, 6)}


def test_resume_fallback_then_pruning_keeps_the_intact_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """keep_checkpoints = 2: after a --resume-fallback past a damaged newest checkpoint (6) to
    step 4 and a run to step 5, the checkpoints are 4 and 5, not the damaged 6 and 5."""
    run = tmp_path / "run"
    keep = ["--set", "training.keep_checkpoints=2", "--set", "training.max_steps=6"]
    assert main(["train", "--run-dir", str(run), *SETS, *keep]) == 0
    assert _names(run) == ["step-0000004", "step-0000006"]
    flip_byte(run / "checkpoints" / "step-0000006" / ckpt.MODEL_FILE)
    fallback = ["--resume", str(run), "--resume-fallback", "--set", "training.max_steps=5"]
    assert main(["train", *fallback]) == 0
    assert f"resumed from {run / 'checkpoints' / 'step-0000004'}" in capsys.readouterr().out
    assert _names(run) == ["step-0000004", "step-0000005"]


# ---------------------------------------------------------------- modes
def test_every_checkpoint_file_follows_the_umask(tmp_path: Path) -> None:
    """model.safetensors (which safetensors creates 0o600), the other parts, the manifest and
    DCP's shards all get 0o666 less the umask, as open() gives."""
    from bdh_train.train.state import SavedText, TrainerState

    model = torch.nn.Linear(2, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    parts: dict[str, Any] = {
        "trainer.json": TrainerState(),
        ckpt.MODEL_FILE: ckpt.ModelWeights(model, dict),
        "optimizer.pt": optimizer,
        "config.toml": SavedText("a = 1\n"),
    }
    old = os.umask(0o027)
    try:
        final = ckpt.Checkpointer(tmp_path).save(
            "step-0000001", parts, sharded=ckpt.ShardedState(model, optimizer)
        )
    finally:
        os.umask(old)
    assert final is not None
    modes = {
        p.relative_to(final).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in ckpt_manifest._checkpoint_files(final)
    }
    assert modes == {
        name: 0o640
        for name in (
            "config.toml",
            ckpt.MANIFEST,
            ckpt.MODEL_FILE,
            "optimizer.pt",
            "sharded/.metadata",
            "sharded/__0_0.distcp",
            "trainer.json",
        )
    }
