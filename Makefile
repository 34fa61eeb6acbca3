PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
# PyPI's Linux torch wheel is the CUDA build (GBs of nvidia-* wheels); a CPU-only machine can take the CPU build with
# TORCH_INDEX=https://download.pytorch.org/whl/cpu. Empty: pip's own configuration (index, find-links) decides.
TORCH_INDEX ?=

.PHONY: run test bench wheelhouse clean-venv

# Offline install for a node without a package index (docs/install.md): every wheel kdexp needs besides torch, for
# WHEEL_PYTHON on Linux. WHEEL_HAVE names packages the node has already (with their dependencies), WHEEL_HAVE_FILE is
# `pip freeze` taken on the node (exact); WHEEL_MAX_MIB fails a folder larger than that.
WHEEL_PYTHON ?= 3.12
WHEEL_HAVE ?=
WHEEL_HAVE_FILE ?=
WHEEL_MAX_MIB ?=
WHEELHOUSE ?= wheelhouse
# `make test` runs pytest on TEST_WORKERS pytest-xdist workers, each module's tests on one worker (its module fixtures
# built once), the heaviest modules first, each worker's torch on its share of the cores (tests/conftest.py). Two: the
# cores of a small machine; more workers only make the multi-process tests wait for each other.
TEST_WORKERS ?= 2

# The venv is created once; torch is installed first, pinned to the version the suite is tested with, so that
# `pip install -e .` finds it satisfied and pulls no other build. The editable install is setuptools' "compat" mode (a
# .pth naming the checkout): Hydra finds launcher plugins by walking the hydra_plugins namespace on sys.path, and the
# default editable finder maps hydra_plugins.kdexp_launcher by name only, so Hydra's discovery would not see it.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	@touch $@

run: $(VENV)/.installed
	$(PY) -m kdexp.run $(ARGS)

# The checkout's bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set (as on this project's machine)
# the source would otherwise be compiled again in each of the suite's hundreds of processes.
test: $(VENV)/.installed
	$(VENV)/bin/ruff check kdexp conf launchers tests
	$(PY) -m compileall -q kdexp conf launchers hydra_plugins tests
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m kdexp.bench.losses $(ARGS)

wheelhouse: $(VENV)/.installed
	$(PY) -m kdexp.launchers.wheelhouse --python $(WHEEL_PYTHON) --out $(WHEELHOUSE) \
		$(if $(WHEEL_HAVE),--have $(WHEEL_HAVE)) $(if $(WHEEL_HAVE_FILE),--have-file $(WHEEL_HAVE_FILE)) \
		$(if $(WHEEL_MAX_MIB),--max-mib $(WHEEL_MAX_MIB))

clean-venv:
	rm -rf $(VENV)
