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

test: $(STAMP)
	JAXFORMER_SMALL=1 $(PY) -m pytest -n 2 -q --nbmake $(TEST_PATHS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) .pytest_cache
