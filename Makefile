# `make serve`: set up a virtual environment and serve the built-in model (executor + scheduler).
# `make test`: the whole test suite (what CI runs, through .ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0 triton==3.7.1

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

.PHONY: install serve test lint
install: $(VENV)/.installed

serve: install
	$(VENV)/bin/pagedserve serve

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	scripts/lint-imports.sh $(PY)
	$(PY) -m pagedserve.protos.generate --check

test: lint
	$(PY) -m pytest
