# Entry points for a fresh Debian/Ubuntu machine: `make demo`, `make test` and `make docs`.
# Each creates the virtual environment and installs what it needs, once.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# mkdocs-material's banner about its successor is noise in a CI log
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: setup demo test docs clean

$(FASHION_MNIST):
	$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.14.1 / torchvision 0.29.1 are the tested pins (any torch >= 2.2 works)
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[demo,test,timm,plot,docs,onnx,clip]'
	touch $@

setup: $(VENV)/.installed $(FASHION_MNIST)

demo: setup
	$(VENV)/bin/cafa demo

# the documentation site (mkdocs.yml) into site/: open site/index.html, search works offline
docs: $(VENV)/.installed
	$(MKDOCS) build --strict

# the linter and formatter (ruff, configured in pyproject.toml), the site's strict build
# (a broken link or anchor, or a page left out of the navigation, fails it; built in a
# temporary folder so that site/ is left as it is; not --quiet, which silences the warnings
# that --strict counts, so the build passes whatever they say), then one worker a core (pytest-xdist),
# each a single torch thread (tests/conftest.py); pass PYTEST_ARGS='-n 0' for one process
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	site=$$(mktemp -d) && $(MKDOCS) build --strict -d "$$site"; status=$$?; rm -rf "$$site"; exit $$status
	$(PY) -m pytest -q -n auto --dist worksteal $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) cafa-demo site
