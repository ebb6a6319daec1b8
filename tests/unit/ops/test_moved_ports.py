"""A service of `flywheel up` whose configured port is taken moves to the next free one: the
stack records the move, `flywheel up` prints a warning naming the service, both ports and the
address clients must use, and `flywheel status` shows it from the state file."""

from __future__ import annotations

import io
import json
import socket

import pytest

from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.ops.service import Service
from flywheel.ops.stack import STATE_FILE, Stack
from flywheel.ops.status import collect_status, render
from flywheel.ops.up import moved_port_warnings


@pytest.fixture
def taken_port():
    """A port another process's server listens on (a real socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _stack(tmp_path, **sections) -> Stack:
    return Stack(load_settings(**sections), echo=lambda _: None)


def test_a_taken_port_is_moved_and_recorded(tmp_path, taken_port):
    stack = _stack(tmp_path)
    free = free_port()
    try:
        got = stack._port(taken_port, "gateway")
        assert got != taken_port
        assert stack._port(free, "trainer") == free  # not taken: stays, nothing recorded
        assert stack.moved == {"gateway": (taken_port, got)}
    finally:
        for reservation in stack.ports:
            reservation.release()


def test_a_teacher_port_that_is_taken_is_recorded_too(tmp_path, taken_port):
    stack = _stack(
        tmp_path,
        teacher={"enabled": True, "port": taken_port, "engine_port": free_port()},
    )
    try:
        stack._teacher_ports()
        configured, got = stack.moved["teacher"]
        assert configured == taken_port and got != taken_port
        assert stack.settings.teacher.port == got
    finally:
        for reservation in stack.ports:
            reservation.release()


def test_up_warns_with_the_address_to_use_and_status_shows_it(tmp_path, taken_port):
    stack = _stack(tmp_path, state_dir=str(tmp_path))
    try:
        got = stack._port(taken_port, "gateway")
    finally:
        for reservation in stack.ports:
            reservation.release()
    url = f"http://127.0.0.1:{got}"
    stack.services.append(Service("gateway", url, "flywheel.gateway", lambda: True))
    assert moved_port_warnings(stack) == [
        f"WARNING: gateway is on port {got}, not its configured port {taken_port} (that one "
        f"is taken). Clients must use {url} as printed; a client config that keeps this port "
        f"may reach another deployment once a later `flywheel up` gets {taken_port} again. "
        "`flywheel status` shows the addresses in use."
    ]
    stack._write_state()
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["gateway"] == url
    assert state["moved_ports"] == {"gateway": {"configured": taken_port, "port": got}}

    # `flywheel status` against that state: every address is a closed port here, so each
    # probe fails at once; the moved port is reported all the same.
    closed = free_port()
    state["redis_url"] = f"redis://127.0.0.1:{closed}/0"
    for name in ("engine", "trainer"):
        state[name] = f"http://127.0.0.1:{closed}"
    report = collect_status(load_settings(), state)
    assert report.to_json()["moved_ports"] == {"gateway": {"configured": taken_port, "port": got}}
    assert any(s.name == "gateway" and s.target == f"{url}/readyz" for s in report.services)
    from rich.console import Console  # noqa: PLC0415

    console = Console(file=io.StringIO(), width=400)
    console.print(render(report))
    screen = console.file.getvalue()
    assert (
        f"WARNING: gateway runs on port {got}, not its configured port {taken_port} (taken "
        "when the stack started); clients must use the address above." in screen
    )


def test_the_demo_warns_of_a_moved_port_as_flywheel_up_does(tmp_path, monkeypatch, capsys):
    """`flywheel demo` on a stack of its own whose gateway's configured port was taken prints
    the same WARNING line `flywheel up` does, with the address it got."""
    import flywheel.ops.stack as stack_module  # noqa: PLC0415
    from flywheel.ops import cli  # noqa: PLC0415
    from flywheel.ops.demo import runner as runner_module  # noqa: PLC0415

    class MovedStack:
        def __init__(self, settings, config_file=None):  # noqa: ANN001
            self.redis = None
            self.moved = {"gateway": (8000, 8001)}
            self.services = [
                Service("gateway", "http://127.0.0.1:8001", "", lambda: True),
                Service("engine", "http://127.0.0.1:30000", "", lambda: True),
            ]

        def start(self) -> None: ...

        def stop(self) -> None: ...

    summary = {"first5": 0.2, "last5": 0.8, "eval_before": 0.5, "eval_after": 0.9, "steps": 2}
    monkeypatch.setattr(stack_module, "Stack", MovedStack)
    monkeypatch.setattr(runner_module.DemoRunner, "run", lambda self, started_at=None: summary)
    monkeypatch.setattr(runner_module.DemoRunner, "access_refusal", lambda self: None)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--new-stack", "--out", str(out), "--steps", "2"]) == 0
    console = capsys.readouterr()
    expected = moved_port_warnings(MovedStack(None))  # type: ignore[arg-type]
    assert expected and expected[0].startswith("WARNING: gateway is on port 8001")
    assert expected[0] in console.out + console.err, console
