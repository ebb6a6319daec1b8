"""`flywheel up`'s supervision (ops/up.py `Supervisor`) on a stand-in stack and clock: a service
that exits is started again with one line, at most `max_restarts` times within `window_s`
seconds, then the stack is stopped with the service's exit report; and the wait for an attached
engine (engine_launch.py `wait_attached`) says at once what it waits for, then how long."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flywheel.core.engine_settings import EngineSettings
from flywheel.ops.engine_launch import wait_attached
from flywheel.ops.up import Supervisor


@dataclass
class FakeService:
    name: str
    healthy: bool = False

    def health(self) -> bool:
        return self.healthy

    def exit_report(self) -> str:
        return f"{self.name} exited with -9; the end of its log x.log:\nboom"


@dataclass
class FakeStack:
    services: list[FakeService]
    dead: list[str] = field(default_factory=list)
    revived: list[str] = field(default_factory=list)
    state_dir: Path = Path(".flywheel")

    def exited(self) -> list[FakeService]:
        return [s for s in self.services if s.name in self.dead]

    def revive(self, name: str) -> int | None:
        self.dead.remove(name)
        self.revived.append(name)
        next(s for s in self.services if s.name == name).healthy = False  # starting
        return -9


def test_restarts_within_the_window_then_stops_the_stack():
    reward = FakeService("reward")
    stack = FakeStack([FakeService("gateway", True), reward])
    now = [0.0]
    said: list[str] = []
    sup = Supervisor(stack, max_restarts=2, window_s=100, say=said.append, clock=lambda: now[0])
    assert sup.check() == "" and said == []  # all running: nothing to do

    stack.dead.append("reward")
    assert sup.check() == ""
    assert stack.revived == ["reward"]
    assert said[0].startswith("reward exited with -9; started it again (1 of 2 within 100 s)")
    reward.healthy = True
    now[0] = 5.0
    assert sup.check() == ""
    assert said[1] == "reward is healthy again (5 s after restart)"

    # t=50: second restart (2 of 2); t=90: a third exit within 100 s of the first stops.
    now[0] = 50.0
    stack.dead.append("reward")
    assert sup.check() == "" and "(2 of 2 within 100 s)" in said[-1]
    assert len(said) == 3  # not healthy yet: no line
    now[0] = 90.0
    stack.dead.append("reward")
    stop = sup.check()
    assert stop.startswith("reward exited with -9; the end of its log x.log:\nboom")
    assert "reward exited 3 times within 100 s (supervise.max_restarts = 2)" in stop
    assert stack.revived == ["reward", "reward"]


def test_restarts_older_than_the_window_do_not_count():
    stack = FakeStack([FakeService("gateway")])
    now = [0.0]
    sup = Supervisor(stack, max_restarts=1, window_s=60, say=lambda _: None, clock=lambda: now[0])
    for t in (0.0, 61.0, 122.0):  # each exit 61 s after the last: the window holds only one
        now[0] = t
        stack.dead.append("gateway")
        assert sup.check() == ""
    assert stack.revived == ["gateway"] * 3


def test_max_restarts_zero_stops_at_the_first_exit():
    stack = FakeStack([FakeService("trainer")], dead=["trainer"])
    sup = Supervisor(stack, max_restarts=0, window_s=60, say=lambda _: None)
    assert "trainer exited 1 times within 60 s" in sup.check() and stack.revived == []


def test_waiting_for_an_attached_engine_says_so_at_once_and_then_how_long():
    lines: list[str] = []
    engine = EngineSettings(backend="external", urls=["http://127.0.0.1:9"], model_path="/m")
    with pytest.raises(TimeoutError, match="did not answer /health with 200 within 1.5s"):
        wait_attached(engine.urls, engine, 1.5, lines.append, progress_s=0.5)
    assert lines[0] == "engine    waiting for http://127.0.0.1:9/health (up to 1.5 s)"
    progress = lines[1:]
    assert len(progress) >= 2, lines  # at 0.5 s and 1 s at least (0.5 s between checks)
    assert all(
        ln.startswith("engine    still waiting for http://127.0.0.1:9/health (") for ln in progress
    )
    assert all(ln.endswith(" s of 1.5 s)") for ln in progress)
