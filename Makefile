# `make train`, `make test` and `make docs` set everything up themselves: a .venv with the
# package installed in editable mode, reinstalled whenever pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test docs bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,interop,wandb,eval,docs,serve]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# The tests and the notebooks (run by nbmake at tiny sizes: JAXFORMER_SMALL=1);
# e.g. `make test TEST_PATHS=tests/model/test_transformer.py` for one file.
TEST_PATHS ?= tests notebooks

# Most of the suite's time is XLA:CPU compiling small programs. For the tests LLVM runs at
# -O0 and fusions go through the classic emitters rather than the MLIR fusion emitters
# (each about halves a small program's compile time; the optimized HLO, which the HLO
# tests read, is the same), and the test processes (workers, train.py and mesh
# subprocesses) share a persistent cache of the programs that take over 0.1 s to compile
# (JAX's default is 1 s: the tests that start train.py over and over, tests/training's
# test_loop and test_checkpoint, ran in 58-60 s rather than 69-71 s; tests in one process
# took as long). XLA's HLO verifier (a check of XLA's own passes after each pipeline) is
# skipped, and LLVM compiles each program as one module rather than split for parallel
# codegen, which two busy workers cannot use: together 15% less compile time and 9-11%
# less wall time in test_transformer's flags-together cases (41-42 s of compile, 88-91 s,
# against 49 s and 99-100 s); neither changes a compiled program.
TEST_ENV := JAXFORMER_SMALL=1 JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache \
	JAX_COMPILATION_CACHE_MAX_SIZE=2000000000 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.1 \
	XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false \
	--xla_disable_hlo_passes=hlo-verifier --xla_cpu_parallel_codegen_split_count=1"

# A worker that compiles past the kernel's limit on memory mappings segfaults (every
# compiled program holds its code mapped); tests/conftest.py drops JAX's compiled programs
# before that. A test whose worker process dies still runs again, up to twice (a failed
# assertion does not), and the summary line counts the reruns. --dist worksteal keeps both
# workers busy until the end.
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist worksteal -q --nbmake --reruns 2 \
		--only-rerun "crashed while running" $(TEST_PATHS) $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/: the notebooks are executed first
# at their tiny sizes, so their pages show their outputs (the tests build it without).
docs: $(STAMP)
	JAXFORMER_SMALL=1 JAXFORMER_DOCS_EXECUTE=true NO_MKDOCS_2_WARNING=1 \
		$(PY) -m mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) .pytest_cache .jax_cache site
