"""`flywheel up` against a state dir another stack holds: one line that says what to do, exit
1, no traceback, and nothing of the other stack touched."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest

from flywheel.ops.cli import main
from flywheel.ops.stack import LOCK_FILE, STATE_FILE

from .http_stub import healthy_gateway


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
    assert f"(`FLYWHEEL_STATE_DIR={state} flywheel down` once it is up" in run.stderr
    assert "Traceback" not in run.stderr
    assert "flywheel is up" not in run.stdout and "stopped." not in run.stdout


@pytest.mark.parametrize("state_dir", [None, "runs/exp1/state"])
def test_up_beside_a_running_stack_names_the_command_that_stops_it(
    tmp_path, monkeypatch, capsys, state_dir
):
    """The running stack's gateway answers and its process (this one) is alive: a second `up`
    from the same state dir says how to stop it, with FLYWHEEL_STATE_DIR only when it is not
    the default one."""
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    args = ["up"]
    if state_dir:
        (tmp_path / "f.toml").write_text(f'state_dir = "{state_dir}"\n')
        args += ["--config", "f.toml"]
    state = tmp_path / (state_dir or ".flywheel")
    state.mkdir(parents=True)
    with healthy_gateway() as gateway:
        (state / STATE_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway": gateway}))
        assert main(args) == 1
    command = f"FLYWHEEL_STATE_DIR={state_dir} flywheel down" if state_dir else "flywheel down"
    err = capsys.readouterr().err
    assert f"already running from {state_dir or '.flywheel'}; stop it first with `{command}`" in err
