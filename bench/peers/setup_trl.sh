#!/usr/bin/env sh
# A separate venv with TRL for bench/peers/trl_grpo.py (never the project's .venv). torch is
# pinned to the project's 2.13.0 first so pip takes the same CPU build. Idempotent.
set -eu
VENV="${FLYWHEEL_PEERS_DIR:-$HOME/.cache/flywheel/peers}/trl"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl" 2>/dev/null; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "torch==2.13.0"
  "$VENV/bin/pip" install --quiet trl datasets "torch==2.13.0"
fi
"$VENV/bin/python" -c "import torch, trl; print('torch', torch.__version__, 'trl', trl.__version__)"
echo "$VENV"
