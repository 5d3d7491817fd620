# The two commands of the README. Each one creates or refreshes .venv and installs pdserve first,
# so either works alone on a fresh machine with Python >= 3.11.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: up test lint format bench clean install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test,mooncake,bench,cuda]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/pdserve up --routers 1 --prefill 1 --decode 1

test: $(STAMP)
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/ruff format --check pdserve tests benchmarks
	$(BIN)/mypy
	MKL_CBWR=AUTO,STRICT $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format pdserve tests benchmarks
	$(BIN)/ruff check --fix pdserve tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
