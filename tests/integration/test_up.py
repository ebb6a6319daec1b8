"""`flywheel up` as a user runs it: a config file, a real Redis it starts itself, every service
healthy and printed, and Ctrl-C (SIGINT) stopping all of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_prints_urls_and_ctrl_c_stops_everything(tmp_path, tiny_model_dir):
    tiny = tiny_model_dir
    state = tmp_path / "state"
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(
        f'state_dir = "{state}"\n'
        f'[redis]\nport = 16379\n[engine]\nmodel_path = "{tiny}"\nport = 31500\n'
        f'[gateway]\nport = 8500\n[reward]\nport = 50551\nmetrics_port = 9501\n'
        f'[trainer]\nport = 8600\ncheckpoint_dir = "{state}/ckpt"\n'
        f'metrics_path = "{state}/m.jsonl"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "up", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "flywheel is up" in line:
                break
        out = "".join(lines)
        assert "flywheel is up" in out, out
        for name in ("redis", "engine", "gateway", "reward", "trainer"):
            assert any(ln.startswith(name) for ln in lines), out
        stack = json.loads((state / "stack.json").read_text())
        assert stack["gateway"] == "http://127.0.0.1:8500"
        assert httpx.get(f"{stack['gateway']}/readyz").status_code == 200
        second = subprocess.run([sys.executable, "-m", "flywheel.cli", "up", "--config",
                                 str(cfg)], capture_output=True, text=True, env=env, timeout=60)
        assert second.returncode == 1 and "already running" in second.stderr
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis-server, engine, gateway, reward, trainer
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped." in rest
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after Ctrl-C: {alive}"
    assert not (state / "stack.json").exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{stack['gateway']}/healthz", timeout=2)
