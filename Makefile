# Two entry points for a fresh Debian/Ubuntu machine: `make demo` and `make test`.
# Each creates the virtual environment and installs what it needs, once.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: setup demo test clean

$(FASHION_MNIST):
	$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.14.1 / torchvision 0.29.1 are the tested pins (any torch >= 2.2 works)
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[demo,test,timm,plot,docs,onnx]'
	touch $@

setup: $(VENV)/.installed $(FASHION_MNIST)

demo: setup
	$(VENV)/bin/cafa demo

# the linter and formatter (ruff, configured in pyproject.toml), then one worker a core
# (pytest-xdist), each a single torch thread (tests/conftest.py);
# pass PYTEST_ARGS='-n 0' for one process
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n auto --dist worksteal $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) cafa-demo
