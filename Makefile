# Two entry points a fresh machine needs: `make demo` (train + sample) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint mutate bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/bdh-train train

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(PY) -m pytest -x -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

# Mutation testing of the core modules (docs/testing.md); not part of `make test` or CI.
# One module: make mutate MODULE=train/schedules.py. Installs the pinned `mutate` extra first.
mutate: $(STAMP)
	$(PY) -c "import importlib.metadata as m; assert m.version('mutmut') == '3.8.1'" 2>/dev/null \
		|| $(PY) -m pip install -q -e '.[mutate]'
	nice -n 19 $(PY) tools/mutate.py $(MODULE)

clean:
	rm -rf $(VENV) runs
