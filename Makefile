# Two entry points a fresh machine needs: `make demo` (train + sample) and `make test`.
# Benchmarks are run one script at a time (benchmarks/, docs/benchmarks.md), never by make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# What ruff lints and formats; mypy's files are set in pyproject.toml ([tool.mypy]: src).
CODE := src tests benchmarks tools

.PHONY: setup demo browser test lint format typecheck mutate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The demo's run directory, the one the README's examples name. A second `make demo` is refused
# by train's run-directory rule (it never clears a run): resume it, remove it, or name another
# (make demo DEMO_RUN=runs/demo2).
DEMO_RUN ?= runs/demo

demo: $(STAMP)
	$(VENV)/bin/bdh-train train --run-dir $(DEMO_RUN)

# The report's browser test (tests/inspection) loads report.html in Debian's Chromium: installed
# here when it is missing, apt-get exists and we are root; otherwise this says why and that
# test is skipped.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "no chromium and not root: the browser test is skipped"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "no chromium, no apt-get: the browser test is skipped"; \
	else apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null) \
		|| echo "apt-get could not install chromium: the browser test is skipped"; fi

# Lint, format check, type check, then the tests: the first failure stops it (CI: .ci/run).
# The tests run in TEST_WORKERS pytest-xdist processes, one per core of the 2-core machine
# CI has (each test then runs one torch thread: tests/helpers.py TEST_THREADS). A file's
# tests share a worker (its module fixtures are built once), and files with long tests go
# first (tests/conftest.py). TEST_WORKERS=0 runs every test in this one process.
# pytest runs with PYTHONDONTWRITEBYTECODE cleared, so Python caches bytecode even where the
# environment turns caching off: the suite starts about 40 Python processes, and without the
# cache each compiled bdh_train anew (0.4 s of CPU) and each worker rewrote every test file's
# asserts (4 s).
TEST_WORKERS ?= 2

test: $(STAMP) browser
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/mypy
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -x -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder

lint: $(STAMP)
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)

# Rewrites files: ruff's formatting (line length 100), which `make test` checks.
format: $(STAMP)
	$(VENV)/bin/ruff format $(CODE)

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Mutation testing of the core modules (docs/testing.md); not part of `make test` or CI.
# One module: make mutate MODULE=train/schedules.py. Installs the pinned `mutate` extra first.
mutate: $(STAMP)
	$(PY) -c "import importlib.metadata as m; assert m.version('mutmut') == '3.8.1'" 2>/dev/null \
		|| $(PY) -m pip install -q -e '.[mutate]'
	nice -n 19 $(PY) tools/mutate.py $(MODULE)

clean:
	rm -rf $(VENV) runs
