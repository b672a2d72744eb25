# `make serve`: set up a virtual environment and serve the built-in model: gRPC on :50051 and the
# OpenAI-compatible gateway on :8000 (executor + scheduler + gateway).
# `make test`: lint, the documentation build and the whole test suite (what CI runs, through .ci/run).
# `make docs`: the documentation site (MkDocs + Material) into site/.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0 triton==3.7.1

# PYTHONWARNINGS: setuptools reports every editable install with a warning that asks nothing of anyone.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

.PHONY: install serve test lint docs
install: $(VENV)/.installed

serve: install
	$(VENV)/bin/pagedserve serve --openai-port 8000

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	scripts/lint-imports.sh $(PY)
	$(PY) -m pagedserve.protos.generate --check

# --strict: a broken link or anchor, or a page missing from the nav, fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# Two workers, each taking whole files (a file's tests share the services it starts): the suite is
# mostly waiting on processes it started, so two workers on two cores take ~60% of one's time.
test: lint docs
	$(PY) -m pytest -n 2 --dist loadfile
