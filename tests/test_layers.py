"""The package's layers, lowest first, and the rule that an import never runs back up.

The same order is drawn in docs/architecture.md; a module may import its own layer and any
layer below it. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bdh_train

PACKAGE_ROOT = Path(bdh_train.__file__).parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("bdh_train.errors", "bdh_train.utils", "bdh_train.checks")),
    ("vocabulary", ("bdh_train.batch",)),
    ("model", ("bdh_train.model", "bdh_train.interop", "bdh_train.export")),
    ("data", ("bdh_train.data",)),
    ("distributed", ("bdh_train.distributed",)),
    ("train", ("bdh_train.train",)),
    ("config", ("bdh_train.config",)),
    ("trainer", ("bdh_train.trainer", "bdh_train.inference", "bdh_train.completions")),
    ("cli", ("bdh_train.cli", "bdh_train.__main__", "bdh_train")),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of the longest prefix that names `module`'s package or module."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and the architecture"
    return best


def imported_modules(path: Path) -> set[str]:
    """Every bdh_train module the file imports (`from bdh_train import x` names x itself when
    x is a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "bdh_train"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "bdh_train":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                sub = PACKAGE_ROOT.parent / Path(*candidate.split("."))
                found.add(candidate if sub.with_suffix(".py").exists() or sub.is_dir() else base)
    return found


def test_every_module_is_in_a_layer() -> None:
    for path in PACKAGE_ROOT.rglob("*.py"):
        layer_of(module_name(path))


def test_no_import_runs_back_up() -> None:
    upward = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        source = module_name(path)
        for target in sorted(imported_modules(path)):
            if layer_of(target) > layer_of(source):
                upward.append(
                    f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_the_architecture_page_draws_these_layers() -> None:
    page = (PACKAGE_ROOT.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    order = " → ".join(name for name, _ in LAYERS)
    assert order in page, f"docs/architecture.md must state the layer order: {order}"
