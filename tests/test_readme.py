"""Every example in README.md runs as written from a fresh clone, so none can rot.

The ```bash and ```python blocks run in the README's order, in one copy of the repository (no
.git, .venv or runs: what a clone has), with `bdh-train` on PATH and
BDH_TRAIN_MAX_STEPS=2 in the environment: every `train` command trains at most 2 steps past
where it starts and `eval` reads at most 2 batches (`bdh_train.utils.steps_cap`); nothing else
is changed. A bash block runs under `bash -e -o pipefail` with no input (so `chat` meets the
end of its input at once) and must exit 0. Later blocks use what earlier ones wrote
(runs/shakespeare), as a reader going down the page does.

`bdh-train` and `python` blocks are served by forks of one process that imported torch and
bdh-train once (`readme_shim.py`); bash itself, the arguments it builds and the files it
redirects are real. A block that cannot run here says so on the line above its fence:
`<!-- readme-test: skip KIND -->`, KIND one of `SKIP_KINDS`; it must still parse, and it must
contain what its kind names (a skip cannot hide a block that would run).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bdh_train.storage.checkpoint import resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHIM = Path(__file__).resolve().parent / "readme_shim.py"
STEPS = "2"

SKIP_KINDS = {
    "setup": ("make ", "creates .venv and installs torch and bdh-train from PyPI (network)"),
    "torchrun": ("torchrun", "starts processes with torchrun; tests/training/ runs them"),
    "gpu": ("cuda", "needs a CUDA device; benchmarks/gpu.sh runs it on one"),
    "network": ("pip install", "installs from PyPI and reads a data set from the Hugging Face Hub"),
}
"""kind -> (text the block must contain, why it is not run here)."""

MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s+(\S+)\s*-->")
FENCE = re.compile(r"```(\w+)\s*$")
IGNORED = ("README*", ".git", ".venv", "runs", "__pycache__", "*_cache", ".hypothesis", "mutants")


@dataclass
class Block:
    lang: str
    text: str
    line: int
    skip: str | None

    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang} block)"


def readme_blocks(text: str) -> list[Block]:
    """The fenced bash and python blocks, each with its skip kind (None: it runs)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.fullmatch(lines[i].strip())
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        if opening.group(1) in ("bash", "python"):
            body = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(opening.group(1), body, i + 1, marker and marker.group(1)))
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A copy of the repository as a clone has it, a `bdh-train` on PATH served by the fork
    server, and the environment the blocks run in."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "clone"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    socket_path = root / "shim.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MPLBACKEND": "Agg"}
    env.pop("BDH_PROFILE", None)
    server = subprocess.Popen(
        [sys.executable, str(SHIM), "serve", str(socket_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        bin_dir = root / "bin"
        bin_dir.mkdir()
        shim = f'exec {sys.executable} -S {SHIM} bdh-train {socket_path} "$@"\n'
        (bin_dir / "bdh-train").write_text("#!/bin/sh\n" + shim)
        (bin_dir / "bdh-train").chmod(0o755)
        env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]])
        env["BDH_TRAIN_MAX_STEPS"] = STEPS
        yield work, env, socket_path
    finally:
        if server.poll() is None and socket_path.exists():
            stop = _STOP.format(str(SHIM.parent), str(socket_path))
            subprocess.run([sys.executable, "-S", "-c", stop], timeout=60)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


_STOP = "import sys; sys.path.insert(0, {!r}); import readme_shim; readme_shim.stop({!r})"


def _run(block: Block, work: Path, env: dict[str, str], socket_path: Path) -> None:
    if block.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    else:
        script = work / f"readme_block_{block.line}.py"
        script.write_text(block.text)
        cmd = [sys.executable, "-S", str(SHIM), "python", str(socket_path), str(script)]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    took = time.perf_counter() - started
    assert proc.returncode == 0, (
        f"{block.where()} exited {proc.returncode} after {took:.1f} s:\n{block.text}\n"
        f"--- stdout (end) ---\n{proc.stdout[-3000:]}\n--- stderr (end) ---\n{proc.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_every_readme_block_runs_from_a_clone(clone):
    work, env, socket_path = clone
    ran = [b for b in BLOCKS if b.skip is None]
    assert sum(b.lang == "bash" for b in ran) >= 8, "the README's shell blocks were not found"
    for block in ran:
        _run(block, work, env, socket_path)
    # runs/shakespeare trained 2 steps, and its --resume (max_steps=2000) 2 more
    assert resolve_checkpoint(work / "runs/shakespeare").name == "step-0000004"


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.skip is not None], ids=lambda b: f"line{b.line}"
)
def test_a_block_not_run_says_why_and_parses(block):
    assert block.skip in SKIP_KINDS, (
        f"{block.where()}: unknown skip kind {block.skip!r}; known: {', '.join(SKIP_KINDS)}"
    )
    needs, why = SKIP_KINDS[block.skip]
    assert needs in block.text, (
        f"{block.where()} is skipped as {block.skip!r} ({why}) but has no {needs!r}"
    )
    if block.lang == "bash":
        proc = subprocess.run(["bash", "-n", "-c", block.text], capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.where()} does not parse: {proc.stderr}"
    else:
        ast.parse(block.text, block.where())


def test_blocks_are_found_with_their_markers():
    """The parser on a README made here: a marked block, a plain one, other languages."""
    text = (
        "# t\n```bash\necho a\n```\n<!-- readme-test: skip gpu -->\n\n```bash\nx --device cuda\n"
        "```\n```text\nout\n```\n```python\nprint(1)\n```\n"
    )
    got = [(b.lang, b.text, b.line, b.skip) for b in readme_blocks(text)]
    assert got == [
        ("bash", "echo a\n", 2, None),
        ("bash", "x --device cuda\n", 7, "gpu"),
        ("python", "print(1)\n", 13, None),
    ]
