# The two commands of the README: `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of PyTorch; on a GPU machine run `make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" setup` instead.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test lint train clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_SPEC)
	$(PIP) install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

train: setup
	$(VENV)/bin/tidal train examples/embodied/cartpole_ppo.yaml

clean:
	rm -rf $(VENV) runs
