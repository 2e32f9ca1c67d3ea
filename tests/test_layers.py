"""The package's layers, lowest first, and the rules that an import never runs back up and
that the modules of one layer import each other without a loop.

The same order is drawn in docs/architecture.md; a module may import its own layer and any
layer below it. Lazy imports inside functions count too: a function-level import whose target
imports back is a loop like any other (only imports under `if TYPE_CHECKING:`, which run no
code, are left out of the loop check).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bdh_train

PACKAGE_ROOT = Path(bdh_train.__file__).parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("bdh_train.errors", "bdh_train.utils", "bdh_train.checks")),
    ("vocabulary", ("bdh_train.batch",)),
    ("model", ("bdh_train.model",)),
    ("storage", ("bdh_train.storage",)),
    ("data", ("bdh_train.data",)),
    ("distributed", ("bdh_train.distributed",)),
    ("engine", ("bdh_train.train",)),
    ("config", ("bdh_train.config",)),
    ("shared", ("bdh_train.shared",)),
    (
        "applications",
        (
            "bdh_train.training",
            "bdh_train.generation",
            "bdh_train.evals",
            "bdh_train.export",
            "bdh_train.inspect",
            "bdh_train.compose",
        ),
    ),
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


@dataclass(frozen=True)
class Import:
    """One import statement's bdh_train module, where it stands and whether it runs."""

    target: str
    line: int
    lazy: bool
    """Inside a function (runs when the function is called)."""
    type_checking: bool
    """Under `if TYPE_CHECKING:` (never runs)."""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    node: ast.AST, lazy: bool = False, type_checking: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under `node`, with whether it is inside a function and whether
    it is under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy, type_checking
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for part in child.body:
                yield from _import_nodes(ast.Module(body=[part], type_ignores=[]), lazy, True)
            for part in child.orelse:
                yield from _import_nodes(
                    ast.Module(body=[part], type_ignores=[]), lazy, type_checking
                )
        else:
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _import_nodes(child, inner, type_checking)


def imports(path: Path) -> list[Import]:
    """Every import of a bdh_train module in the file (`from bdh_train import x` names x itself
    when x is a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    for node, lazy, type_checking in _import_nodes(tree):
        targets: set[str] = set()
        if isinstance(node, ast.Import):
            targets = {a.name for a in node.names if a.name.split(".")[0] == "bdh_train"}
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "bdh_train":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                sub = PACKAGE_ROOT.parent / Path(*candidate.split("."))
                targets.add(candidate if sub.with_suffix(".py").exists() or sub.is_dir() else base)
        found += [Import(target, node.lineno, lazy, type_checking) for target in sorted(targets)]
    return found


def imported_modules(path: Path) -> set[str]:
    """Every bdh_train module the file imports (`from bdh_train import x` names x itself when
    x is a submodule)."""
    return {found.target for found in imports(path)}


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def runs_on_import(module: str) -> set[str]:
    """The bdh_train modules that importing `module` runs, by the module-level imports alone:
    the module, its packages, and what each of them imports, transitively."""
    paths, done = modules(), set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in done or name not in paths:
            continue
        done.add(name)
        todo.append(name.rpartition(".")[0])
        todo += [i.target for i in imports(paths[name]) if not i.lazy and not i.type_checking]
    return done


LAZY_PACKAGES = ("bdh_train", "bdh_train.train", "bdh_train.distributed")
"""Packages whose public names are imported on first use (PEP 562 `__getattr__`)."""


def layer_import_graph() -> dict[str, dict[str, Import]]:
    """Module -> the modules of its own layer it imports (each with its first import that
    runs): module-level and function-level imports alike, TYPE_CHECKING ones left out."""
    graph: dict[str, dict[str, Import]] = {}
    for source, path in modules().items():
        edges = graph.setdefault(source, {})
        for found in imports(path):
            target = found.target
            if found.type_checking or target == source or layer_of(target) != layer_of(source):
                continue
            if target not in edges or (edges[target].lazy and not found.lazy):
                edges[target] = found
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The graph's strongly connected components (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def shortest_loop(graph: dict[str, dict[str, Import]], members: list[str]) -> list[str]:
    """A shortest chain of imports inside `members` that comes back to where it began: through
    a function-level import when the loop has one (the import that keeps it importable), else
    from the first member."""
    inside = set(members)
    lazy = sorted(
        (source, target)
        for source in members
        for target, found in graph[source].items()
        if target in inside and found.lazy
    )
    start, first_steps = (lazy[0][0], [lazy[0][1]]) if lazy else (members[0], None)
    paths: dict[str, list[str]] = {}
    queue: list[str] = []
    for target in first_steps or sorted(t for t in graph[start] if t in inside):
        paths[target] = [start, target]
        queue.append(target)
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node]):
            if target == start:
                return [*paths[node], start]
            if target in inside and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"no loop through {start}")


def describe_loop(graph: dict[str, dict[str, Import]], members: list[str]) -> str:
    chain = shortest_loop(graph, members)
    steps = [f"{len(members)} modules in one loop: {', '.join(members)}", chain[0]]
    for source, target in zip(chain, chain[1:], strict=False):
        found = graph[source][target]
        where = "inside a function" if found.lazy else "module level"
        steps.append(f"  imports {target} ({module_path(source)}:{found.line}, {where})")
    return "\n".join(steps)


def module_path(module: str) -> str:
    return modules()[module].relative_to(PACKAGE_ROOT.parents[1]).as_posix()


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


def test_no_import_loop_inside_a_layer() -> None:
    graph = layer_import_graph()
    loops = [
        describe_loop(graph, members) for members in strongly_connected(graph) if len(members) > 1
    ]
    assert not loops, (
        "import loops inside a layer (a function-level import that keeps a loop importable is "
        "still a loop: move what both sides need into a module below them):\n\n"
        + "\n\n".join(loops)
    )


def test_the_loop_check_sees_function_level_imports_and_skips_type_checking_ones() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import bdh_train.errors\n"
        "if TYPE_CHECKING:\n"
        "    import bdh_train.utils\n"
        "def f():\n"
        "    import bdh_train.checks\n"
    )
    found = [
        (node.names[0].name, lazy, type_checking)
        for node, lazy, type_checking in _import_nodes(ast.parse(source))
        if node.names[0].name.startswith("bdh_train")
    ]
    assert found == [
        ("bdh_train.errors", False, False),
        ("bdh_train.utils", False, True),
        ("bdh_train.checks", True, False),
    ]
    tokens, prepared = "bdh_train.data.tokens", "bdh_train.data.prepared"
    graph = {
        tokens: {prepared: Import(prepared, 7, lazy=True, type_checking=False)},
        prepared: {tokens: Import(tokens, 3, lazy=False, type_checking=False)},
    }
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [[prepared, tokens]]
    assert shortest_loop(graph, [prepared, tokens]) == [tokens, prepared, tokens]


def test_lazy_packages_import_no_submodule_when_imported() -> None:
    """Importing one submodule (`bdh_train.storage.checkpoint`) runs its package's __init__,
    which must not import every sibling (and through them `bdh_train.distributed`)."""
    for package in LAZY_PACKAGES:
        found = imports(modules()[package])
        running = sorted(
            {
                i.target
                for i in found
                if not i.lazy and not i.type_checking and layer_of(i.target) > 0
            }
        )  # the base layer (its lazy-name helper) imports only the standard library
        assert not running, (
            f"the __init__ of {package} imports {running} when imported: import its public "
            "names on first use (`_LAZY` and `__getattr__`)"
        )


def test_importing_a_submodule_runs_only_what_it_imports() -> None:
    script = (
        "import sys\n"
        "import bdh_train.storage.checkpoint\n"
        "print(sorted(m for m in sys.modules if m.startswith('bdh_train')))\n"
        "import bdh_train.config\n"
        "words = ('planner', 'fsdp', 'pipelin')\n"
        "print(sorted(m for m in sys.modules if any(w in m for w in words)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    checkpoint_run, config_run = (ast.literal_eval(line) for line in proc.stdout.splitlines())
    assert set(checkpoint_run) <= runs_on_import("bdh_train.storage.checkpoint"), checkpoint_run
    assert config_run == [], (
        f"importing bdh_train.config (the sections' dataclasses) imports {config_run}: the "
        "pipeline planner, FSDP or the pipeline runner"
    )
