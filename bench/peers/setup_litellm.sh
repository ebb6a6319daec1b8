#!/usr/bin/env sh
# A separate venv with LiteLLM's proxy for bench/peers/gateway_overhead.py (never the project's
# .venv: litellm pins versions that conflict with it). Idempotent.
set -eu
VENV="${FLYWHEEL_PEERS_DIR:-$HOME/.cache/flywheel/peers}/litellm"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/litellm" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "litellm[proxy]"
fi
"$VENV/bin/python" -c "import litellm, importlib.metadata as m; print('litellm', m.version('litellm'))"
echo "$VENV"
