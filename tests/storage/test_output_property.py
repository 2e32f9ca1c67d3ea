"""A property of every command that writes an output (inspect's report, eval --out, export
--ternary and --hf, grow and merge, --save-state, corpus, prepare), each through the function
its command writes with: whatever sequence of commands, --force, kills and targets it meets
(a missing path, a user's file or folder, a FIFO, links to a file, a folder or nowhere, a run
directory, a run's config, a place inside a checkpoint, an earlier output), a command either
succeeds where the policy allows it or raises a BDHTrainError (one error line and exit 2 in
the CLI), never changes a user's file, link, FIFO or run, and a successful command of a kind
leaves none of the temporaries a killed one of its kind left."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import entry_digest, tiny_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bdh_train.data.prepared import prepare_corpus
from bdh_train.data.sources import write_builtin_corpus
from bdh_train.errors import BDHTrainError
from bdh_train.evals.measures import _write as write_eval_results
from bdh_train.export.huggingface.writer import write_directory
from bdh_train.export.ternary import export_ternary
from bdh_train.generation.continuation import Continuation
from bdh_train.inspect.analysis import InspectOptions, inspect_model, write_report
from bdh_train.model.quant import QuantConfig
from bdh_train.storage import checkpoint as ckpt
from bdh_train.storage.places import LAYOUT

FILE_COMMANDS = ("save_state", "export_ternary", "corpus", "eval")
DIR_COMMANDS = ("inspect", "export_hf", "grow", "merge", "prepare")
FORCE_FLAG = {"export_hf": False, "grow": False, "merge": False}
"""Commands without --force (their output path must be new)."""
TARGETS = (
    "missing",
    "user_file",
    "user_dir",
    "fifo",
    "link_file",
    "link_dir",
    "dangling",
    "run",
    "run_config",
    "in_checkpoint",
)


@dataclass
class Writers:
    inspection: object
    state: Continuation
    ternary: torch.nn.Module
    corpus: Path


@dataclass
class Retention:
    """A stand-in measure result: eval writes any result as its JSON."""

    losses: list[float]


def _write_weights(directory: Path) -> None:
    (directory / ckpt.MODEL_FILE).write_bytes(b"weights")


def run_command(w: Writers, command: str, path: Path, force: bool) -> None:
    """The command's own writing function on `path`."""
    if command == "inspect":
        write_report(w.inspection, path, hubs=4, force=force)  # type: ignore[arg-type]
    elif command == "export_hf":
        write_directory(path, {"config.json": b"{}", "README.md": b"# m\n"})
    elif command in ("grow", "merge"):
        ckpt.publish_checkpoint_dir(path, _write_weights, command)
    elif command == "prepare":
        prepare_corpus([w.corpus], path, force=force, progress=False)
    elif command == "save_state":
        w.state.save(path, force)
    elif command == "export_ternary":
        export_ternary(w.ternary, path, force=force)  # type: ignore[arg-type]
    elif command == "corpus":
        write_builtin_corpus("shakespeare", path, force)
    elif command == "eval":
        assert path.name == "retention.json"
        write_eval_results({"retention": Retention([1.0])}, path.parent, force)


def _target(base: Path, kind: str, command: str) -> Path:
    name = "retention.json" if command == "eval" else "out"
    if kind == "run":
        return base / "run" if command != "eval" else base / "run" / name
    if kind == "run_config":  # eval writes DIR/retention.json: a DIR inside the run's files
        return base / "run" / ("tensorboard/retention.json" if command == "eval" else "config.toml")
    if kind == "in_checkpoint":
        return base / "run" / "checkpoints" / "step-0000005" / name
    return base / f"t_{kind}" / name


def _plant(base: Path) -> None:
    """The user's things: victims, a run, and what each target starts as."""
    (base / "victim.txt").write_text("precious")
    (base / "victimdir").mkdir()
    (base / "victimdir" / "thesis.txt").write_text("three years")
    step = base / "run" / "checkpoints" / "step-0000005"
    step.mkdir(parents=True)
    (base / "run" / "config.toml").write_text("# config\n")
    (base / "run" / "metrics.jsonl").write_text("{}\n")
    (step / ckpt.MODEL_FILE).write_bytes(b"w")
    (step / ckpt.MANIFEST).write_text("{}")
    for kind in TARGETS[:7]:
        for name in ("out", "retention.json"):
            path = base / f"t_{kind}" / name
            path.parent.mkdir(exist_ok=True)
            if kind == "user_file":
                path.write_text(f"the user's {name}")
            elif kind == "user_dir":
                path.mkdir()
                (path / "mine.txt").write_text("mine")
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "link_file":
                path.symlink_to(base / "victim.txt")
            elif kind == "link_dir":
                path.symlink_to(base / "victimdir")
            elif kind == "dangling":
                path.symlink_to(base / "nowhere" / name)


def _is_leftover(path: Path) -> bool:
    return path.name.startswith(".") and (".tmp-" in path.name or ".old-" in path.name)


def _users(base: Path, ours: set[Path]) -> dict[str, str]:
    """Every entry but our outputs and leftovers: links as links, FIFOs as FIFOs."""
    found = {}
    for path in sorted(base.rglob("*")):
        if any(p in ours or _is_leftover(p) for p in (path, *path.parents)):
            continue
        found[str(path)] = entry_digest(path)
    return found


def _allowed(base: Path, path: Path, command: str, force: bool, made: dict[Path, str]) -> bool:
    """Whether the policy lets `command` write `path` as it is now (`made`: our outputs)."""
    run = base / "run"
    if path == run or (path.is_relative_to(run) and path.relative_to(run).parts[0] in LAYOUT):
        return False  # the run, its files and folders, inside its checkpoints
    if not os.path.lexists(path):
        if path not in made or command in FILE_COMMANDS:
            return True
        # a dir command first puts back the output a kill set aside: as an earlier output
        return force and FORCE_FLAG.get(command, True) and made[path] == command
    if FORCE_FLAG.get(command, True) is False or not force:
        return False
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        return not path.exists()  # only a dangling link, as a link
    if command in FILE_COMMANDS:
        return stat.S_ISREG(mode)
    return stat.S_ISDIR(mode) and made.get(path) == command


def _kill(path: Path, command: str, made: dict[Path, str], count: int) -> None:
    """What a killed publish of `command` leaves: its output set aside between the renames
    (when `path` holds one), else a half-built temporary."""
    if made.get(path) == command and path.is_dir() and not path.is_symlink():
        aside = path.parent / f".{path.name}.old-killed{count:02d}"
        aside.mkdir()
        path.rename(aside / path.name)  # still ours: `made` keeps it, at its new place
    else:
        half = path.parent / f".{path.name}.tmp-killed{count:02d}"
        half.mkdir(exist_ok=True)
        (half / "partial").write_bytes(b"\x00" * 3)


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("run"),
            st.sampled_from(FILE_COMMANDS + DIR_COMMANDS),
            st.sampled_from(TARGETS),
            st.booleans(),
        ),
        st.tuples(st.just("kill"), st.sampled_from(DIR_COMMANDS), st.sampled_from(TARGETS[:3])),
    ),
    min_size=2,
    max_size=7,
)


@pytest.fixture(scope="module")
def writers(tmp_path_factory) -> Writers:
    model = tiny_model(vocab_size=16)
    tokens = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(0))
    options = InspectOptions(block_size=8, graph_neurons=16, edges_per_neuron=2, hubs=4)
    found = inspect_model(model, tokens, None, options)
    found.numbers |= {"checkpoint": "tiny", "data": "random ids"}
    state = Continuation(model)
    state.feed([1, 2, 3])
    ternary = tiny_model(vocab_size=16, quant=QuantConfig(enable=True))
    corpus = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} text"}) + "\n" for i in range(6)))
    return Writers(found, state, ternary, corpus)


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@example(  # every command on every target, with and without --force
    ops=[
        ("run", command, target, force)
        for force in (False, True)
        for target in TARGETS
        for command in FILE_COMMANDS + DIR_COMMANDS
    ]
)
@example(  # each kind killed while building, and killed between the renames of a --force
    ops=[
        op
        for command in DIR_COMMANDS
        for op in (
            ("kill", command, "missing"),
            ("run", command, "missing", False),
            ("kill", command, "missing"),
            ("run", command, "missing", False),  # the output set aside is back: it exists
            ("run", command, "missing", True),
            ("kill", command, "missing"),
            ("kill", command, "missing"),
            ("run", command, "missing", True),
            ("run", "corpus", "missing", True),  # a file in its place: the next one refuses
            ("run", command, "missing", True),
        )
    ]
)
@given(ops=OPS)
def test_no_writing_command_touches_a_users_file_and_kills_are_cleaned(writers, monkeypatch, ops):
    monkeypatch.setattr("bdh_train.inspect.analysis.sparsity_figure", lambda *args: "")
    monkeypatch.setattr("bdh_train.inspect.analysis.degree_figure", lambda *args: "")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        _plant(base)
        made: dict[Path, str] = {}
        for count, op in enumerate(ops):
            if op[0] == "kill":
                _kill(_target(base, op[2], op[1]), op[1], made, count)
                continue
            _, command, kind, force = op
            path = _target(base, kind, command)
            allowed = _allowed(base, path, command, force, made)
            before = _users(base, set(made) | {path})
            try:
                run_command(writers, command, path, force)
                ok = True
            except BDHTrainError:
                ok = False
            assert ok == allowed, f"{op}: {'wrote' if ok else 'refused'} against the policy"
            if ok:
                assert not path.is_symlink() and path.exists(), op
                made[path] = command
                if command in DIR_COMMANDS:
                    left = [p.name for p in path.parent.iterdir() if _is_leftover(p)]
                    assert not left, f"{left} left after {op}"
            assert _users(base, set(made) | {path}) == before, f"a user's file changed in {op}"
