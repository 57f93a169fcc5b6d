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
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -n 2 -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) .pytest_cache
