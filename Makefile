# `make train` trains k3_tiny on the default corpus; `make test` runs the test suite.
# Both create the pinned Python 3.12 environment in .venv first when it is missing.
# `make test-tpu` compiles for TPUs without one (tests/tpu) with libtpu from .libtpu, kept out of
# .venv: with libtpu importable, every JAX process without JAX_PLATFORMS=cpu tries to open a TPU
# and logs errors on stderr. `make test` runs both.
SHELL := /bin/bash
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $$p && break; done)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/k3_tiny
ARGS ?=
LIBTPU_DIR := .libtpu
# The libtpu that jax[tpu]==0.11.2 pins.
LIBTPU := libtpu==0.0.48.*

.PHONY: setup tpu-setup train test test-tpu
setup: $(VENV)/.installed
tpu-setup: $(LIBTPU_DIR)/.installed

$(VENV)/.installed: requirements.txt setup.cfg pyproject.toml
	@if [ -z "$(PY312)" ]; then echo "Python 3.12 not found (tried python3.12 and ~/.pyenv/versions/3.12*)"; exit 1; fi
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

train: setup
	$(PY) -m launch.train --config=experiments/configs/k3_tiny.py --workdir=$(WORKDIR) $(ARGS)

$(LIBTPU_DIR)/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(LIBTPU_DIR) "$(LIBTPU)"
	touch $@

test: setup tpu-setup
	$(PY) -m pytest -q -n 2 --dist worksteal tests --ignore=tests/tpu $(ARGS)
	$(MAKE) --no-print-directory test-tpu

test-tpu: tpu-setup
	PYTHONPATH=$(abspath $(LIBTPU_DIR)) JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist worksteal tests/tpu
