"""`flywheel up` against a state dir another stack holds: one line that says what to do, exit
1, no traceback, and nothing of the other stack touched."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from flywheel.ops.stack import LOCK_FILE


def test_up_on_a_busy_state_dir_is_one_clear_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(f'state_dir = "{state}"\n')
    fd = os.open(state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another stack is starting from it
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        run = subprocess.run(
            [sys.executable, "-m", "flywheel.ops.cli", "up", "--config", str(cfg)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(fd)
    assert run.returncode == 1
    assert "already running or starting" in run.stderr and "stop it first" in run.stderr
    assert "Traceback" not in run.stderr
    assert "flywheel is up" not in run.stdout and "stopped." not in run.stdout
