# `make train` trains k3_tiny on the default corpus; `make test` runs the test suite.
# Both create the pinned Python 3.12 environment in .venv first when it is missing.
SHELL := /bin/bash
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $$p && break; done)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/k3_tiny
ARGS ?=

.PHONY: setup train test
setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt setup.cfg pyproject.toml
	@if [ -z "$(PY312)" ]; then echo "Python 3.12 not found (tried python3.12 and ~/.pyenv/versions/3.12*)"; exit 1; fi
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

train: setup
	$(PY) -m launch.train --config=experiments/configs/k3_tiny.py --workdir=$(WORKDIR) $(ARGS)

test: setup
	$(PY) -m pytest -q -n 2 tests $(ARGS)
