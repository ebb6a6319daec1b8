"""`flywheel demo --new-stack` stopped by SIGTERM (a job runner, a benchmark's timeout, `kill`)
stops the stack it started: no engine, gateway, reward, trainer or Redis is left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from .up_cli import clean_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sigterm_stops_the_demos_own_stack(tmp_path, tiny_model_dir):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(
        f'[redis]\nport = 16479\n[engine]\nmodel_path = "{tiny_model_dir}"\nport = 31600\n'
        "[gateway]\nport = 8700\n[reward]\nport = 50651\nmetrics_port = 9601\n"
        "[trainer]\nport = 8800\n"
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.ops.cli", "demo", "--new-stack", "--config", str(cfg)]
        + ["--steps", "50", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=clean_env(),
        text=True,
    )
    children: list[psutil.Process] = []
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the first step's line: the whole stack is up
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("step "):
                break
        assert any(ln.startswith("step ") for ln in lines), "".join(lines)
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for service in ("redis-server", "flywheel.engine", "flywheel.gateway", "flywheel.trainer"):
            assert service in names, names
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    assert "demo interrupted; stopping its stack" in rest
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after SIGTERM: {alive}"
