# Two entry points a fresh machine needs: `make demo` (train + sample) and `make test`.
# Benchmarks are run one script at a time (benchmarks/, docs/benchmarks.md), never by make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# What ruff lints and formats; mypy's files are set in pyproject.toml ([tool.mypy]: src).
CODE := src tests benchmarks tools

.PHONY: setup demo test lint format typecheck mutate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/bdh-train train

# Lint, format check, type check, then the tests: the first failure stops it (CI: .ci/run).
test: $(STAMP)
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/mypy
	$(PY) -m pytest -x -p no:cacheprovider

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
