"""The local stack's children run in a session of their own: a terminal's Ctrl-C (SIGINT to the
foreground process group, the command's) reaches only the command, which stops its services in
reverse order and Redis last; and a command killed outright (SIGKILL) leaves no child running.

A real launcher process (`Stack` with its own Redis and one stand-in service) in a process group
of its own, as a terminal's foreground job is; the stand-in records the signals it gets and
whether Redis still answered when it was told to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flywheel.ops.stack import process_alive

SERVICE = textwrap.dedent(
    """
    import signal, socket, sys, time
    record, redis_port = sys.argv[1], int(sys.argv[2])

    def note(line):
        with open(record, "a") as f:
            f.write(line + "\\n")

    def on_int(signum, frame):
        note("SIGINT")

    def on_term(signum, frame):
        try:
            socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()
            note("SIGTERM redis-up")
        except OSError:
            note("SIGTERM redis-down")
        sys.exit(0)

    signal.signal(signal.SIGINT, on_int)
    signal.signal(signal.SIGTERM, on_term)
    note("started")
    while True:
        time.sleep(0.1)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    from flywheel.core.redis_server import LocalRedis
    from flywheel.core.settings import FlywheelSettings
    from flywheel.ops.service import Service
    from flywheel.ops.stack import Stack
    from flywheel.ops.up import stop_on_signals

    state, service_py, record = sys.argv[1:4]
    stack = Stack(FlywheelSettings(state_dir=state))
    stack.state_dir.mkdir(parents=True, exist_ok=True)
    (stack.state_dir / "logs").mkdir(exist_ok=True)
    stack.env = dict(os.environ)
    stack.redis = LocalRedis(stack.state_dir / "redis")
    stack.redis.start()
    command = [sys.executable, service_py, record, str(stack.redis.port)]
    stack._launch(Service("stand-in", "http://127.0.0.1:1", "", lambda: True, command=command))
    print(stack.redis.proc.pid, stack.services[0].proc.pid, flush=True)
    stop_on_signals()
    try:
        while True:
            time.sleep(0.1)
    except KeyboardInterrupt:
        stack.stop()
        print("stopped", flush=True)
    """
)


def _launcher(tmp_path: Path) -> tuple[subprocess.Popen[str], int, int, Path]:
    """The launcher, in a new process group; returns it, Redis's pid, the stand-in's pid and
    the stand-in's record file (once it started)."""
    service_py, launcher_py = tmp_path / "service.py", tmp_path / "launcher.py"
    service_py.write_text(SERVICE)
    launcher_py.write_text(LAUNCHER)
    record = tmp_path / "record.txt"
    proc = subprocess.Popen(
        [sys.executable, str(launcher_py), str(tmp_path / "state"), str(service_py), str(record)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its group stands for the terminal's foreground job
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"the launcher did not start its children: {proc.communicate()}")
    redis_pid, service_pid = map(int, line.split())
    deadline = time.monotonic() + 30
    while not (record.exists() and "started" in record.read_text()):
        assert time.monotonic() < deadline, "the stand-in service never started"
        time.sleep(0.05)
    return proc, redis_pid, service_pid, record


def _kill(proc: subprocess.Popen[str], *pids: int) -> None:
    """Kill whatever of the launcher and its children still runs (a failed test's leftovers)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_reaches_only_the_launcher_which_stops_redis_last(tmp_path):
    proc, redis_pid, service_pid, record = _launcher(tmp_path)
    try:
        group = os.getpgid(proc.pid)
        assert os.getpgid(redis_pid) != group and os.getsid(redis_pid) != os.getsid(proc.pid)
        assert os.getpgid(service_pid) != group and os.getsid(service_pid) != os.getsid(proc.pid)
        os.killpg(group, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=60)
    finally:
        _kill(proc, redis_pid, service_pid)
    assert proc.returncode == 0 and "stopped" in out, (out, err)
    lines = record.read_text().splitlines()
    assert "SIGINT" not in lines, lines
    assert "SIGTERM redis-up" in lines, lines
    assert _gone(redis_pid, 10) and _gone(service_pid, 10)


def test_a_killed_launcher_leaves_no_child_running(tmp_path):
    proc, redis_pid, service_pid, _record = _launcher(tmp_path)
    try:
        proc.kill()
        proc.wait(timeout=10)
        assert _gone(service_pid, 15), "the service outlived its launcher"
        assert _gone(redis_pid, 15), "redis-server outlived its launcher"
    finally:
        _kill(proc, redis_pid, service_pid)
