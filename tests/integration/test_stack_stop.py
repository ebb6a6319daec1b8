"""Stopping a stack from outside: `flywheel demo --new-stack` stopped by SIGTERM (a job runner, a
benchmark's timeout, `kill`) and `flywheel up` stopped by `flywheel down` from another shell
leave no engine, gateway, reward, trainer or Redis behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from .up_cli import clean_env, up_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def read_until(proc: subprocess.Popen, marker: str, timeout_s: float = 300) -> str:
    """`proc`'s output up to and including the first line containing `marker` (a leading "\n"
    in `marker` matches a line's start), or all of it if it ends or `timeout_s` passes first;
    lines joined with a newline in front of each."""
    lines = [""]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in "\n" + line:
            break
    return "\n".join(x.rstrip("\n") for x in lines)


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
    try:
        out = read_until(proc, "\nstep ")  # the first step's line: the whole stack is up
        assert "\nstep " in out, out
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
    assert proc.returncode == 143, rest  # 128 + SIGTERM
    assert "demo interrupted; stopping its stack" in rest
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after SIGTERM: {alive}"


def test_flywheel_down_stops_the_stack_of_the_state_dir(tmp_path, tiny_model_dir):
    state = tmp_path / "state"
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(
        f'state_dir = "{state}"\n'
        f'[redis]\nport = 16579\n[engine]\nmodel_path = "{tiny_model_dir}"\nport = 31700\n'
        "[gateway]\nport = 8900\n[reward]\nport = 50751\nmetrics_port = 9701\n"
        "[trainer]\nport = 8950\n"
    )
    down = [sys.executable, "-m", "flywheel.ops.cli", "down", "--config", str(cfg)]
    nothing = subprocess.run(down, capture_output=True, text=True, env=clean_env(), timeout=60)
    assert nothing.returncode == 1 and "no stack runs from state dir" in nothing.stderr
    up = subprocess.Popen(
        up_command(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=clean_env(),
        text=True,
    )
    children: list[psutil.Process] = []
    try:
        out = read_until(up, "flywheel is up")
        assert "flywheel is up" in out, out
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 5  # redis-server, engine, gateway, reward, trainer
        stopped = subprocess.run(down, capture_output=True, text=True, env=clean_env(), timeout=240)
        assert stopped.returncode == 0, stopped.stderr
        assert f"(process {up.pid})" in stopped.stdout and "stopped." in stopped.stdout
        rest, _ = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, rest
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after flywheel down: {alive}"
    assert not (state / "stack.json").exists()
