# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-gpu protos clean prometheus

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) -m specdec.demo

# CPU tests; Triton kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
test: setup prometheus
	$(PY) -m pytest -q tests

# Debian's prometheus for the observability tests, installed when missing and we are root; never
# fails the build (those tests skip, saying why, without it). Only the binary is used: the tests
# start it on a loopback port with their own config and stop it.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq >/dev/null 2>&1 \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } \
	  || echo "prometheus not installed: the tests that need it will skip"

# On a CUDA machine with torch/triton already installed (the device machine): GPU-marked tests only,
# in 8 processes sharing the GPU where pytest-xdist is installed (the device image has it).
test-gpu:
	python3 -m pytest -q -m gpu $$(python3 -c 'import xdist' 2>/dev/null && echo '-n 8') tests

protos: setup
	$(PY) -m protos.codegen

clean:
	rm -rf $(VENV) .pytest_cache
