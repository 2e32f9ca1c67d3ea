"""Mutation testing of the core modules with mutmut, one module at a time.

    python tools/mutate.py [MODULE ...]      (MODULE relative to src/bdh_train, e.g.
                                              train/schedules.py; default: all of MODULE_TESTS)

Each module runs in its own build/mutate/<module>/ (wiped first, so every run measures the
current code and tests): src, tests, configs and docs are linked in, and pyproject.toml is the
project's with [tool.mutmut] narrowed to that module (only_mutate) and the fast test files that
guard it (pytest_add_cli_args_test_selection). mutmut only runs the tests that reach a mutated
function, so a small selection keeps its tracing stats phase and every mutant short.

Every surviving mutant is either listed in tools/mutation_equivalents.toml (function, the
mutated line, and why no test can tell it from the original) or reported as NOT KILLED; the exit
status is 1 when any mutant is not killed and not listed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutate"
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.toml"
LINKED = ("src", "tests", "configs", "docs")

MODULE_TESTS: dict[str, list[str]] = {
    "train/schedules.py": ["tests/train/test_schedules.py"],
    "train/accumulate.py": ["tests/train/test_accumulate.py"],
    "train/reduce.py": ["tests/train/test_reduce.py"],
    "storage/checkpoint.py": ["tests/storage/test_checkpoint.py"],
    "storage/manifest.py": ["tests/storage/test_checkpoint.py"],
    "model/state.py": ["tests/model/test_model_state.py"],
    "model/mixer.py": ["tests/model/test_mixer.py"],
    "model/chunked_grad.py": ["tests/model/test_mixer.py"],
    "model/matmul.py": ["tests/model/test_matmul.py"],
    "model/gate.py": ["tests/model/test_gate.py"],
    "model/recording.py": [
        "tests/model/test_matmul.py",
        "tests/model/test_gate.py",
        "tests/model/test_mixer.py",
    ],
    "train/step.py": ["tests/train/test_step.py"],
    "completions.py": ["tests/cli/test_cli_inference.py"],
    "model/generate.py": [
        "tests/model/test_fast_decode.py",
        "tests/model/test_generation_api.py",
        "tests/model/test_model_generate.py",
        "tests/model/test_summary_memory.py",
        "tests/model/test_alibi_learned.py",
        "tests/model/test_nca_head.py",
        "tests/generation/test_continuation.py",
        "tests/test_api.py",
    ],
}
"""The modules under mutation testing, in the order they run, and the test files that guard
each (the multiprocess and compiling tests are deselected by [tool.mutmut]
pytest_add_cli_args)."""


@dataclass
class Survivor:
    name: str  # mutmut's mutant name, e.g. bdh_train.train.schedules.x__get__mutmut_2
    status: str  # survived, no tests, timeout, suspicious, ...
    function: str  # the mutant's function, mutmut's mangling undone: GradientScaleSchedule.__init__
    removed: str  # the original line(s), stripped and joined with " / "
    added: str  # the mutated line(s), the same way
    reason: str | None = None  # why it is equivalent, from EQUIVALENTS; None: not killed
    kind: str = ""  # "equivalent"; "needs-cuda": only a CUDA device or NCCL can tell it apart;
    # "needs-compile": only a test that compiles with torch.compile can (dynamo cannot trace
    # mutmut's trampolines, so those tests stay out of the mutation run)


def _slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", "_")


def _function_of(name: str) -> str:
    """`bdh_train.train.schedules.xǁGradientScaleScheduleǁ__init____mutmut_5` ->
    `GradientScaleSchedule.__init__`; `...x__get__mutmut_2` -> `_get`."""
    mangled = re.sub(r"__mutmut_\d+$", "", name).rsplit(".", 1)[1]
    if mangled.startswith("xǁ"):
        return ".".join(mangled[2:].split("ǁ"))
    return mangled.removeprefix("x_")


def _prepare(module: str) -> Path:
    workdir = WORK / _slug(module)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for name in LINKED:
        (workdir / name).symlink_to(ROOT / name, target_is_directory=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    settings = project["tool"]["mutmut"]
    settings["only_mutate"] = [f"src/bdh_train/{module}"]
    settings["pytest_add_cli_args_test_selection"] = MODULE_TESTS[module]
    (workdir / "pyproject.toml").write_text(tomli_w.dumps(project))
    return workdir


def _mutmut(workdir: Path, *args: str, log: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut sets sys.path
    command = [sys.executable, "-m", "mutmut", *args]
    if log is None:
        return subprocess.run(
            command, cwd=workdir, env=env, check=True, capture_output=True, text=True
        ).stdout
    with log.open("w") as out:
        subprocess.run(command, cwd=workdir, env=env, check=True, stdout=out, stderr=out)
    return ""


def _load_equivalents() -> list[dict[str, str]]:
    if not EQUIVALENTS.exists():
        return []
    return tomllib.loads(EQUIVALENTS.read_text()).get("equivalent", [])


_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
print(json.dumps({n: get_diff_for_mutant(n, path=find_mutant(n).path) for n in sys.argv[1:]}))
"""
"""Run in a work directory: the diff of each named mutant, as JSON (one process for all)."""


def _survivors(workdir: Path, module: str) -> list[Survivor]:
    listing = [line.strip().rpartition(": ") for line in _mutmut(workdir, "results").splitlines()]
    status_of = {name: status for name, _, status in listing if name}
    checked = [name for name, status in status_of.items() if status != "not checked"]
    if not status_of:
        return []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    diffs = json.loads(
        subprocess.run(
            [sys.executable, "-c", _DIFFS, *checked],
            cwd=workdir,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()[-1]
    )
    equivalents = [e for e in _load_equivalents() if e["module"] == module]
    survivors = []
    for name, status in status_of.items():
        diff = diffs.get(name, "").splitlines()  # none for a mutant the run did not reach
        removed = " / ".join(x[1:].strip() for x in diff if x[:1] == "-" and x[:3] != "---")
        added = " / ".join(x[1:].strip() for x in diff if x[:1] == "+" and x[:3] != "+++")
        survivor = Survivor(name, status, _function_of(name), removed, added)
        for entry in equivalents:
            if (entry["function"], entry["original"], entry["mutant"]) == (
                survivor.function,
                removed,
                added,
            ):
                survivor.reason = entry["reason"]
                survivor.kind = entry.get("kind", "equivalent")
        survivors.append(survivor)
    return survivors


def run_module(module: str, max_children: int, report_only: bool) -> dict[str, object]:
    workdir = WORK / _slug(module)
    if not report_only:
        _prepare(module)
        _mutmut(workdir, "run", "--max-children", str(max_children), log=workdir / "run.log")
    # from writing the work directory's pyproject.toml to mutmut's last progress line
    seconds = (workdir / "run.log").stat().st_mtime - (workdir / "pyproject.toml").stat().st_mtime
    _mutmut(workdir, "export-cicd-stats")
    stats = json.loads((workdir / "mutants" / "mutmut-cicd-stats.json").read_text())
    survivors = _survivors(workdir, module)
    with (workdir / "survivors.json").open("w") as out:
        json.dump([s.__dict__ for s in survivors], out, indent=1, ensure_ascii=False)
    equivalent = sum(s.kind == "equivalent" for s in survivors)
    needs_cuda = sum(s.kind in ("needs-cuda", "needs-compile") for s in survivors)
    not_killed = [s for s in survivors if s.reason is None]
    for s in not_killed:
        print(f"  NOT KILLED ({s.status}) {s.name}\n    - {s.removed}\n    + {s.added}", flush=True)
    total = stats["total"]
    killed = stats["killed"] + stats.get("caught_by_type_check", 0)
    rate = killed / max(total - equivalent - needs_cuda, 1)
    return {
        "module": module,
        "mutants": total,
        "killed": killed,
        "equivalent": equivalent,
        "needs_cuda": needs_cuda,
        "not_killed": len(not_killed),
        "rate": rate,
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="modules under src/bdh_train; default: all")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    parser.add_argument(
        "--report-only", action="store_true", help="tabulate the last run again, run nothing"
    )
    args = parser.parse_args()
    modules = args.modules or list(MODULE_TESTS)
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        print(f"error: unknown module(s) {unknown}; choose from {list(MODULE_TESTS)}")
        return 2
    rows = []
    for module in modules:
        tests = " ".join(MODULE_TESTS[module])
        doing = "last run of" if args.report_only else "mutating"
        print(f"{doing} src/bdh_train/{module} (tests: {tests})", flush=True)
        rows.append(run_module(module, args.max_children, args.report_only))
    print(
        "\n| module | mutants | killed | equivalent | needs CUDA or compile | not killed "
        "| kill rate | run time |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['module']} | {r['mutants']} | {r['killed']} | {r['equivalent']} | "
            f"{r['needs_cuda']} | {r['not_killed']} | {r['rate']:.1%} | {r['seconds']:.0f} s |"
        )
    return 1 if any(r["not_killed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
