PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test bench clean-venv

# The venv is created once; torch is pinned first because an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

run: $(VENV)/.installed
	$(PY) -m kdexp.run $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/ruff check kdexp tests
	$(PY) -m pytest -q -ra $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m kdexp.bench.losses $(ARGS)

clean-venv:
	rm -rf $(VENV)
