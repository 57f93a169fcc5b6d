# `make train` and `make test` set everything up themselves: a .venv with the package
# installed in editable mode, reinstalled whenever pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,interop]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# The tests and the notebooks (run by nbmake at tiny sizes: JAXFORMER_SMALL=1);
# e.g. `make test TEST_PATHS=tests/test_model.py` for one file.
TEST_PATHS ?= tests notebooks

# Most of the suite's time is XLA:CPU compiling small programs. LLVM runs at -O0 for the
# tests (the optimized HLO, which the HLO tests read, is unchanged; only machine-code
# optimisation is skipped), and the test processes (workers, train.py and mesh
# subprocesses) share a persistent cache of the programs that take over a second.
TEST_ENV := JAXFORMER_SMALL=1 JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache \
	JAX_COMPILATION_CACHE_MAX_SIZE=2000000000 XLA_FLAGS=--xla_backend_optimization_level=0

# A test whose worker process dies runs again, up to twice (a failed assertion does not):
# XLA:CPU segfaults now and then, compiling (an eager optax update) or writing a compiled
# program to the persistent cache (jax's put_executable_and_time, in
# test_layer_patterns_scanned_and_rematted_match_the_reference, twice in three full runs),
# and has never done so on the rerun.
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 -q --nbmake --reruns 2 --only-rerun "crashed while running" \
		$(TEST_PATHS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) .pytest_cache .jax_cache
