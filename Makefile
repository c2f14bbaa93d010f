# Two entry points for a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-gpu protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) -m specdec.demo

# CPU tests; Triton kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
test: setup
	$(PY) -m pytest -q tests

# On a CUDA machine with torch/triton already installed (the device machine): GPU-marked tests only.
test-gpu:
	python3 -m pytest -q -m gpu tests

protos: setup
	$(PY) -m protos.codegen

clean:
	rm -rf $(VENV) .pytest_cache
