"""Every path and command README.md and docs/*.md name exists in a clone: the repository's
files and folders they name (`configs/...`, `docs/...`, relative links), the `bdh-train`
subcommands they run, and nothing outside the repository (`../shared/`, which a clone lacks).
docs/benchmarks-history.md is left out: it records past runs as they were typed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bdh_train.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
HISTORY = "benchmarks-history.md"
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != HISTORY)]
TOP = ("configs", "docs", "src", "tests", "benchmarks", "tools", ".ci")
TOP_ALTERNATIVES = "|".join(map(re.escape, TOP))
REPO_PATH = re.compile(rf"(?<![\w./~-])((?:{TOP_ALTERNATIVES})/[\w.*/{{}},-]*[\w*}}])")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
COMMAND = re.compile(r"(?<![\w/.-])bdh-train ([a-z][\w-]*)")
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)


def _exists(base: Path, name: str) -> bool:
    """`name` (a glob, {a,b} alternatives) matches something under `base`."""
    found = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", name)
    if found:
        head, options, tail = found.groups()
        return all(_exists(base, head + option + tail) for option in options.split(","))
    if any(c in name for c in "*?["):
        return any(base.glob(name))
    return (base / name).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_a_document_names_exists(doc):
    text = doc.read_text()
    missing = [p for p in REPO_PATH.findall(text) if not _exists(ROOT, p.rstrip("/."))]
    links = [
        link
        for link in LINK.findall(text)
        if "://" not in link and not link.startswith("mailto:") and not _exists(doc.parent, link)
    ]
    assert not missing and not links, f"{doc.name} names {missing + links}"
    assert "../shared" not in text, f"{doc.name} names ../shared, which a clone does not have"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_bdh_train_command_a_document_runs_exists(doc):
    code = "\n".join(block or span for block, span in CODE.findall(doc.read_text()))
    assert "bdh-train" in code or doc.name != "README.md"
    unknown = sorted(set(COMMAND.findall(code)) - set(COMMANDS))
    assert not unknown, f"{doc.name} runs bdh-train {unknown}, not a command"
