"""The output policy (storage/output.py) as every writing command meets it: an output never
replaces what the command did not create unless --force says so, --force replaces only a
regular file or a directory of the command's kind, nothing is written inside a checkpoint or
a run's files or through a link, a write that fails names its file and leaves nothing, and
the next command of the same kind cleans what a killed one left."""

from __future__ import annotations

import ast
import os
import resource
import stat
from pathlib import Path

import pytest
import torch
from helpers import entry_digest, tiny_model
from safetensors.torch import save_file

from bdh_train.cli import main
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.errors import BDHTrainError
from bdh_train.export.huggingface.writer import Provenance, model_card, write_directory
from bdh_train.inspect.analysis import InspectOptions, inspect_model, write_report
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage import output
from bdh_train.utils import atomic_write


def fake_run(root: Path) -> Path:
    """A run directory's files (config, metrics, one checkpoint, `latest`), enough for the
    policy to know it; commands refuse before they would load it."""
    run = root / "run"
    step = run / "checkpoints" / "step-0000005"
    step.mkdir(parents=True)
    (run / "config.toml").write_text("# the run's config\n")
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    (step / "model.safetensors").write_bytes(b"the weights")
    (step / "manifest.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step-0000005\n")
    return run


def digest(root: Path) -> dict[str, str]:
    """Every entry under `root`, links as links, FIFOs as FIFOs, files by SHA-256."""
    return {str(path): entry_digest(path) for path in sorted(root.rglob("*"))}


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line of a refused command (exit 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def no_figures(monkeypatch):
    """Reports without their figures (matplotlib takes seconds): how a report directory is
    published does not depend on what its page draws."""
    monkeypatch.setattr("bdh_train.inspect.analysis.sparsity_figure", lambda *args: "")
    monkeypatch.setattr("bdh_train.inspect.analysis.degree_figure", lambda *args: "")


@pytest.fixture(scope="module")
def inspection():
    model = tiny_model(vocab_size=16)
    tokens = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(0))
    options = InspectOptions(block_size=8, graph_neurons=16, edges_per_neuron=2, hubs=4)
    found = inspect_model(model, tokens, None, options)
    found.numbers |= {"checkpoint": "tiny", "data": "random ids"}
    return found


# ------------------------------------------------------------------ 1. inspect --out a run
def test_an_inspect_report_never_replaces_a_run_that_holds_an_inspect_json(
    inspection, tmp_path, capsys
):
    run = fake_run(tmp_path)
    (run / "inspect.json").write_text("{}")  # a report copied into the run
    before = digest(tmp_path)
    for force in (False, True):
        with pytest.raises(BDHTrainError, match="is the run directory"):
            write_report(inspection, run, hubs=4, force=force)
    err = refused(capsys, ["inspect", "--checkpoint", str(run), "--out", str(run), "--force"])
    assert "is the run directory" in err
    mine = tmp_path / "mine"  # a user's folder with a report's name in it
    mine.mkdir()
    (mine / "inspect.json").write_text("{}")
    (mine / "thesis.txt").write_text("three years")
    before = digest(tmp_path)
    with pytest.raises(BDHTrainError, match="not an earlier inspect report"):
        write_report(inspection, mine, hubs=4, force=True)
    assert digest(tmp_path) == before


# ------------------------------------------------------------------ 2 and 3. a run's files
@pytest.mark.parametrize(
    "target",
    [
        "config.toml",
        "checkpoints/latest",
        "checkpoints/step-0000005/model.safetensors",
        "checkpoints/step-0000005/state",
        "tensorboard/x",
    ],
)
def test_save_state_never_writes_a_runs_files_or_inside_a_checkpoint(tmp_path, capsys, target):
    run = fake_run(tmp_path)
    before = digest(tmp_path)
    path = str(run / target)
    for command in (["generate", "--prompt", "a"], ["chat"]):
        argv = [*command, "--checkpoint", str(run), "--save-state", path, "--force"]
        err = refused(capsys, argv)
        assert "bdh-train never writes an output there" in err
    assert digest(tmp_path) == before


def test_save_state_and_ternary_export_replace_a_file_only_with_force(tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for argv in (
        ["generate", "--checkpoint", str(tmp_path / "none"), "--save-state", str(mine)],
        ["chat", "--checkpoint", str(tmp_path / "none"), "--save-state", str(mine)],
        ["export", "--ternary", str(tmp_path / "none"), str(mine)],
    ):
        assert "already exists; pass --force" in refused(capsys, argv)
    assert mine.read_text() == "mine"
    assert output.write_file(mine, b"new", "--save-state", force=True) == mine
    assert mine.read_bytes() == b"new"


@pytest.mark.parametrize(
    "argv",
    [
        ["grow", "--checkpoint", "RUN", "--neurons-multiplier", "2", "--out", "OUT"],
        ["merge", "RUN", "RUN", "--out", "OUT"],
        ["inspect", "--checkpoint", "RUN", "--out", "OUT"],
        ["eval", "--checkpoint", "RUN", "--context-curve", "--out", "OUT"],
        ["export", "--hf", "OUT", "RUN"],
    ],
    ids=["grow", "merge", "inspect", "eval", "export-hf"],
)
def test_no_command_writes_inside_a_checkpoint(tmp_path, capsys, argv):
    run = fake_run(tmp_path)
    elsewhere = tmp_path / "standalone"  # a checkpoint outside any run (a grow's output)
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"w")
    (elsewhere / "config.toml").write_text("")
    before = digest(tmp_path)
    for out in (run / "checkpoints" / "step-0000005" / "grown", elsewhere / "sub"):
        line = [str(run) if a == "RUN" else str(out) if a == "OUT" else a for a in argv]
        assert "inside" in refused(capsys, line)
    assert digest(tmp_path) == before


# ------------------------------------------------------------------ 4. devices, FIFOs, links
def test_force_never_replaces_a_fifo_a_device_or_a_link_and_a_dangling_link_needs_it(
    tmp_path, capsys
):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    special = [fifo]
    if os.geteuid() == 0:  # a character device (/dev/null's numbers) in tmp only
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        special.append(tmp_path / "null")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "link").symlink_to(victim)
    before = digest(tmp_path)
    for path in special:
        err = refused(capsys, ["corpus", "shakespeare", "--out", str(path), "--force"])
        assert "replaces only regular files and directories" in err
        with (
            pytest.raises(BDHTrainError, match="replaces only regular files"),
            atomic_write(path) as handle,
        ):
            handle.write("x")
    err = refused(capsys, ["corpus", "shakespeare", "--out", str(tmp_path / "link"), "--force"])
    assert "never writes through a link" in err
    assert digest(tmp_path) == before
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "x.txt")
    err = refused(capsys, ["corpus", "shakespeare", "--out", str(dangling)])
    assert "which does not exist; pass --force to replace the link itself" in err
    assert main(["corpus", "shakespeare", "--out", str(dangling), "--force"]) == 0
    assert not dangling.is_symlink() and dangling.stat().st_size > 0
    assert not (tmp_path / "nowhere").exists()  # the link's target was never written


# ------------------------------------------------------------------ 6. the model card
def test_the_model_card_escapes_the_data_source_and_the_directory_name():
    hostile = "corpus.txt\n## Injected\n<script>alert(1)</script> [x](http://e.invalid) `c`"
    name = 'my "model" ```\nimport os'
    provenance = Provenance(exported_from="checkpoint step-0000005", data=hostile)
    card = model_card(tiny_model(vocab_size=256), ByteTokenizer(), provenance, name)
    assert "<script>" not in card and "\n## Injected" not in card and "](http" not in card
    headings = [line for line in card.splitlines() if line.startswith("#")]
    assert headings == [headings[0], "## Model", "## Training", "## Use"]
    assert "\n" not in headings[0] and "import os" not in card.replace("\\nimport os", "")
    fence = card.split("\n## Use\n", 1)[1].splitlines()[0].removesuffix("python")
    code = card.split(fence + "python\n", 1)[1].split("\n" + fence, 1)[0]
    calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and n.args]
    loads = [c for c in calls if getattr(c.func, "attr", "") == "from_pretrained"]
    assert [c.args[0].value for c in loads] == [name, name]  # type: ignore[attr-defined]


# ------------------------------------------------------------------ 15, 17: a full disk
def test_a_write_past_the_file_size_limit_names_the_file_and_leaves_nothing(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    tensors = {"w": torch.zeros(4096)}

    def composed(directory: Path) -> None:  # as grow and merge write their weights
        with output.writing(directory / "model.safetensors"):
            save_file(tensors, str(directory / "model.safetensors"))

    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(BDHTrainError, match=r"cannot write .*grown/model\.safetensors"):
            ckpt.publish_checkpoint_dir(tmp_path / "made" / "grown", composed, "grow")
        with pytest.raises(BDHTrainError, match=r"cannot write .*hf/big\.bin \(File too large"):
            write_directory(tmp_path / "new" / "hf", {"small": b"x", "big.bin": bytes(8192)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert list(tmp_path.iterdir()) == []  # no temporary, and no parent folder it made


def test_a_published_directory_follows_the_umask_as_a_checkpoint_does(tmp_path):
    """Every directory bdh-train publishes (a merge's, as here, an export's, a run's
    checkpoint) gets the modes open() and mkdir give under the umask, though safetensors
    creates its files 0o600."""

    def composed(directory: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(directory / "model.safetensors"))

    old = os.umask(0o027)
    try:
        merged = ckpt.publish_checkpoint_dir(tmp_path / "merged", composed, "merge")
        saved = ckpt.save_checkpoint(tmp_path / "run", "step-0000001", composed)
    finally:
        os.umask(old)
    for final in (merged, saved):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in final.iterdir()}
        assert modes == {"model.safetensors": 0o640, "manifest.json": 0o640}, final
        assert stat.S_IMODE(final.stat().st_mode) == 0o750


def test_a_rename_that_fails_puts_the_replaced_directory_back(tmp_path, monkeypatch):
    """A --force (or a checkpoint's re-save) whose final rename fails leaves the earlier
    directory in place and no temporary or set-aside folder."""
    out = write_directory(tmp_path / "hf", {"a": b"earlier"})
    saved = ckpt.save_checkpoint(tmp_path, "step-0000001", lambda d: (d / "w").write_bytes(b"1"))
    replace = os.replace

    def failing(src, dst):
        if ".tmp-" in Path(src).name:  # the built directory's rename, not the set-aside ones
            raise OSError(18, "Invalid cross-device link")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(BDHTrainError) as err:
        output.publish_dir(
            out,
            lambda d: (d / "a").write_bytes(b"new"),
            "--hf",
            "x",
            force=True,
            same_kind=lambda p: None,
        )
    assert str(err.value) == (
        f"cannot move the new {out} into place: Invalid cross-device link; the previous one is "
        "left in place"
    )
    with pytest.raises(OSError, match="cross-device"):
        ckpt.save_checkpoint(tmp_path, "step-0000001", lambda d: (d / "w").write_bytes(b"2"))
    assert (out / "a").read_bytes() == b"earlier" and (saved / "w").read_bytes() == b"1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]
    assert sorted(p.name for p in saved.parent.iterdir()) == ["latest", "step-0000001"]


# ------------------------------------------------------------------ 16. what a kill leaves
def test_the_next_command_of_a_kind_cleans_what_a_killed_one_left(
    inspection, no_figures, tmp_path, capsys
):
    out = tmp_path / "report"
    write_report(inspection, out, hubs=4)
    earlier = digest(out)
    killed = tmp_path / ".report.tmp-killed01"  # killed while building
    killed.mkdir()
    (killed / "inspect.json").write_text("{")
    aside = tmp_path / ".report.old-killed02"  # killed between the two renames of a --force
    aside.mkdir()
    out.rename(aside / "report")
    foreign = tmp_path / ".report.tmp-mine"  # a user's folder holding a link: kept
    foreign.mkdir()
    (foreign / "link").symlink_to(tmp_path)
    assert output.clean_leftovers(out) == [aside, killed]
    assert digest(out) == earlier  # the earlier report is back
    capsys.readouterr()
    killed.mkdir()
    write_report(inspection, out, hubs=4, force=True)
    notice = f"left by a `bdh-train inspect` of '{out}' that did not finish"
    assert capsys.readouterr().err == f"notice: removed '{killed}', {notice}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".report.tmp-mine", "report"]


def test_inspect_out_dot_leaves_no_dot_old_folder(inspection, no_figures, tmp_path, monkeypatch):
    report = tmp_path / "rep"
    write_report(inspection, report, hubs=4)
    monkeypatch.chdir(report)
    write_report(inspection, Path("."), hubs=4, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
