"""Two stacks starting at the same instant: ports reserved by one process are never picked by
another, a second stack on the same state dir fails at once (and leaves the first one's state
file alone), and a health answer counts only from the service's own process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from flywheel.core.redis_server import reserve_port
from flywheel.core.settings import load_settings
from flywheel.ops.stack import STATE_FILE, Stack, StackBusyError, listens

RACER = textwrap.dedent("""
    import pathlib, sys, time
    from flywheel.core.redis_server import reserve_port
    go = pathlib.Path(sys.argv[1])
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.001)
    held = [reserve_port(int(sys.argv[2])) for _ in range(6)]
    print(" ".join(str(r.port) for r in held), flush=True)
    sys.stdin.read()  # hold the ports until the test is done
""")


def _racers(tmp_path, script, *args, n=2):
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(go), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()  # both start picking at the same instant
    return procs


def _finish(procs):
    for p in procs:
        p.wait(timeout=60)


def test_processes_reserving_ports_at_once_never_get_the_same_port(tmp_path):
    preferred = reserve_port(0).port  # a free base; both racers prefer the same ports
    procs = _racers(tmp_path, RACER, preferred + 1)
    try:
        got = [set(map(int, p.stdout.readline().split())) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
        _finish(procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert all(len(ports) == 6 for ports in got)
    assert not got[0] & got[1], got
    assert got[0] | got[1] <= set(range(preferred + 1, preferred + 101))


def test_a_reservation_is_exclusive_in_one_process_until_released():
    first = reserve_port(0)
    second = reserve_port(first.port)
    assert second.port != first.port
    first.release()
    again = reserve_port(first.port)
    assert again.port == first.port
    again.release()
    second.release()


SECOND_STACK = textwrap.dedent("""
    import sys
    from flywheel.core.settings import load_settings
    from flywheel.ops.stack import Stack, StackBusyError
    stack = Stack(load_settings(state_dir=sys.argv[1]), echo=lambda _: None)
    try:
        stack.start()
    except StackBusyError as exc:
        print("busy:", exc)
        sys.exit(3)
    finally:
        stack.stop()
""")


def test_a_second_stack_on_the_same_state_dir_fails_at_once(tmp_path):
    first = Stack(load_settings(state_dir=str(tmp_path)), echo=lambda _: None)
    first._lock_state_dir()  # a stack running (or still starting) from this state dir
    (tmp_path / STATE_FILE).write_text(json.dumps({"pid": 1}))
    try:
        second = subprocess.run(
            [sys.executable, "-c", SECOND_STACK, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 3, second.stderr
        assert "already running or starting" in second.stdout
        assert (tmp_path / STATE_FILE).exists()  # the second one's stop left it alone
        with pytest.raises(StackBusyError):
            Stack(load_settings(state_dir=str(tmp_path)), echo=lambda _: None).start()
    finally:
        first.stop()
    assert not (tmp_path / STATE_FILE).exists()
    after = Stack(load_settings(state_dir=str(tmp_path)), echo=lambda _: None)
    after._lock_state_dir()  # free again once the first stack stopped
    after.stop()


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


LISTENER = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    sys.stdin.read()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_port_answered_by_another_process_is_not_the_service(tmp_path):
    other = HTTPServer(("127.0.0.1", 0), _Ok)  # e.g. another stack's service on that port
    threading.Thread(target=other.serve_forever, daemon=True).start()
    own = subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-c",  # a service whose child listens
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {LISTENER!r}])",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(own.stdout.readline())
        nested = int(wrapper.stdout.readline())
        assert listens(own.pid, port)
        assert not listens(own.pid, other.server_port)
        assert listens(wrapper.pid, nested)  # descendants count
        assert listens(os.getpid(), other.server_port)
        assert not listens(wrapper.pid, port)
    finally:
        for p in (own, wrapper):
            p.stdin.close()
            p.wait(timeout=30)
        other.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_service_that_loads_for_a_while_gets_progress_lines(tmp_path, monkeypatch):
    """A trainer loading its model for tens of seconds is not silent: `flywheel up` echoes a
    `still starting` line every STARTING_PROGRESS_S (here 0.3 s) until it is healthy."""
    from flywheel.ops import stack as stack_module  # noqa: PLC0415
    from flywheel.ops.stack import Service  # noqa: PLC0415

    monkeypatch.setattr(stack_module, "STARTING_PROGRESS_S", 0.3)
    lines: list[str] = []
    stack = Stack(load_settings(state_dir=str(tmp_path)), echo=lines.append)
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        ready_at = time.monotonic() + 1.2  # healthy after 1.2 s: about 4 progress lines
        service = Service(
            "trainer", f"http://127.0.0.1:{port}", "x", lambda: time.monotonic() >= ready_at
        )
        service.proc = proc
        service.log_path = tmp_path / "trainer.log"
        stack._wait_healthy(service, timeout_s=30)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    progress = [line for line in lines if "still starting" in line]
    assert 2 <= len(progress) <= 5, lines
    assert re.fullmatch(
        r"trainer   still starting \(\d s of 30 s; log \S+trainer\.log\)", progress[0]
    )
    assert lines[-1].startswith(f"trainer   http://127.0.0.1:{port}  healthy (")
