# The two commands of the README. Each one creates or refreshes .venv and installs pdserve first,
# so either works alone on a fresh machine with Python >= 3.11.
#
# PyTorch (the torch platform, --device cuda) is installed only where it is used. `make up` adds the
# `cuda` extra (PyPI's torch, which carries CUDA: several GB of nvidia-* wheels) on a host with an
# NVIDIA driver, and no torch at all elsewhere: the CPU engine never imports it. `make test` tests
# the torch platform; without a driver it does so on torch's CPU device, with PyTorch's CPU build
# (TORCH_CPU: one page of TORCH_CPU_INDEX, or a local wheel pip's find-links hold where that index
# cannot be reached), then the cuda extra, which the installed CPU build satisfies (Triton comes
# with it: the tests run the kernels under its interpreter).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# yes where an NVIDIA driver is, found as `--device auto` finds it (pdserve/engine/platform.py);
# `make up CUDA=yes` or `CUDA=` decides instead
CUDA   ?= $(shell { [ -d /proc/driver/nvidia/gpus ] || ls /dev/nvidia[0-9]*; } >/dev/null 2>&1 && echo yes)
TORCH_CPU       ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
comma  := ,
# what make up installed, per pip's report (tests/test_packaging.py checks it names no CUDA wheel)
UP_REPORT  := $(VENV)/up-install.json
UP_STAMP   := $(VENV)/.installed-up$(if $(CUDA),-cuda)
TEST_STAMP := $(VENV)/.installed-test$(if $(CUDA),-cuda)

.PHONY: up test lint format bench clean install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(UP_STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install --quiet --report $(UP_REPORT) -e '.[test,mooncake,bench$(if $(CUDA),$(comma)cuda)]'
	touch $@

# a torch already in the venv is kept (it runs on the CPU too); the second install brings the
# CPU build's dependencies and Triton
$(TEST_STAMP): $(UP_STAMP)
ifeq ($(CUDA),)
	if ! $(BIN)/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; then \
		$(BIN)/python -m pip install --quiet --no-deps --retries 1 --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH_CPU)'; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[test,mooncake,bench,cuda]'
endif
	touch $@

install: $(UP_STAMP)

up: $(UP_STAMP)
	$(BIN)/pdserve up

test: $(TEST_STAMP)
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/ruff format --check pdserve tests benchmarks
	$(BIN)/mypy
	MKL_CBWR=AUTO,STRICT $(BIN)/python -m pytest -q

lint: $(TEST_STAMP)
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/mypy

format: $(TEST_STAMP)
	$(BIN)/ruff format pdserve tests benchmarks
	$(BIN)/ruff check --fix pdserve tests benchmarks

bench: $(UP_STAMP)
	$(BIN)/python benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
