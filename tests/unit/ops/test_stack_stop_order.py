"""Stopping the stack stops the trainer first and waits for it: its last push, which it finishes
on its way out, still finds the engines serving.

Real child processes started by `Stack._launch`: a stand-in engine that answers on a socket
until it is told to stop, and a stand-in trainer that, told to stop, pushes once more to that
engine (connects to its socket) before it exits, and records whether the push got through."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

from flywheel.core.settings import FlywheelSettings
from flywheel.ops.service import Service
from flywheel.ops.stack import Stack

ENGINE = textwrap.dedent(
    """
    import os, signal, socket, sys
    record, port_file = sys.argv[1], sys.argv[2]

    def note(line):
        with open(record, "a") as f:
            f.write(line + "\\n")

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def on_term(signum, frame):
        note("engine stopped")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    while True:
        conn, _ = server.accept()
        conn.sendall(b"ok")
        conn.close()
    """
)

TRAINER = textwrap.dedent(
    """
    import signal, socket, sys, time
    record, port_file = sys.argv[1], sys.argv[2]

    def note(line):
        with open(record, "a") as f:
            f.write(line + "\\n")

    def on_term(signum, frame):
        time.sleep(0.5)  # the step's checkpoint and push still being written
        port = int(open(port_file).read())
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                reply = conn.recv(2)
            note("trainer push " + ("ok" if reply == b"ok" else "failed"))
        except OSError:
            note("trainer push failed")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    note("trainer started")
    while True:
        time.sleep(0.1)
    """
)


def _wait_for(path: Path, text: str) -> None:
    deadline = time.monotonic() + 60
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path} never had {text!r}"
        time.sleep(0.05)


def test_the_trainer_stops_and_pushes_before_the_engine_is_stopped(tmp_path):
    engine_py, trainer_py = tmp_path / "engine.py", tmp_path / "trainer.py"
    engine_py.write_text(ENGINE)
    trainer_py.write_text(TRAINER)
    record, port_file = tmp_path / "record.txt", tmp_path / "engine.port"
    stack = Stack(FlywheelSettings(state_dir=str(tmp_path / "state")), echo=lambda _: None)
    (stack.state_dir / "logs").mkdir(parents=True)
    stack.env = dict(os.environ)
    args = [str(record), str(port_file)]
    try:
        engine = [sys.executable, str(engine_py), *args]
        stack._launch(Service("engine", "http://127.0.0.1:1", "", lambda: True, command=engine))
        _wait_for(port_file, "")
        trainer = [sys.executable, str(trainer_py), *args]
        stack._launch(Service("trainer", "http://127.0.0.1:1", "", lambda: True, command=trainer))
        _wait_for(record, "trainer started")
    finally:
        stack.stop(grace_s=30)
    assert record.read_text().splitlines() == [
        "trainer started",
        "trainer push ok",
        "engine stopped",
    ]
    assert not stack.services
