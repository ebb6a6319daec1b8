"""Ctrl-C during `flywheel demo`: the demo writes what the steps done so far give (summary.json
marked interrupted with the step reached, reward_curve.png, timeline.png), says where, stops the
stack it started and exits 130. A real SIGINT to this process, sent by a stub gateway and engine
over real HTTP when the run's second training step begins; the stack's start and stop are
fakes that record the calls."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

import flywheel.ops.stack as stack_module
from flywheel.ops import cli
from flywheel.ops.demo.runner import DemoConfig, DemoRunner

from ..core.http_stub import JsonHandler, serving


class _Stub(JsonHandler):
    """Gateway and engine in one: sessions, a chat turn answering "5", finish, and
    `/model_info` at weight version 0. Sends SIGINT to this process when the training session
    number `interrupt_at` is created (eval sessions do not count)."""

    interrupt_at = 3
    training_sessions = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/model_info":
            self._json(200, {"weight_version": "0"})
        else:
            self._json(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        port = self.server.server_address[1]  # type: ignore[index]
        if self.path == "/v1/sessions":
            sid = f"s{uuid.uuid4().hex[:8]}"
            if not body.get("eval"):
                with self.lock:
                    type(self).training_sessions += 1
                    if type(self).training_sessions == self.interrupt_at:
                        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, in the main thread
            self._json(200, {"session_id": sid, "base_url": f"http://127.0.0.1:{port}/s/{sid}/v1"})
        elif self.path.endswith("/chat/completions"):
            message = {"role": "assistant", "content": "5"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            self._json(
                200,
                {
                    "id": "c1",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": "m",
                    "choices": [choice],
                },
            )
        elif self.path.endswith("/finish"):
            self._json(200, {})
        else:
            self._json(404, {"error": {"message": "no such route"}})


@pytest.fixture
def stub() -> Iterator[str]:
    """The stub's base URL (the signal handlers the demo installs are restored by conftest)."""
    _Stub.training_sessions = 0
    with serving(_Stub) as url:
        yield url


def test_ctrl_c_writes_the_summary_of_the_steps_done_stops_the_stack_and_exits_130(
    monkeypatch, tmp_path, stub, capsys
):
    calls: list[str] = []

    class Service:
        def __init__(self, name: str):
            self.name, self.url = name, stub

    class FakeStack:
        def __init__(self, settings, config_file=None):  # noqa: ANN001
            self.services = [Service("gateway"), Service("engine")]
            self.redis, self.moved = None, {}  # every configured port was free

        def start(self) -> None:
            calls.append("start")

        def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr(stack_module, "Stack", FakeStack)
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    out = tmp_path / "demo"
    argv = ["demo", "--new-stack", "--out", str(out), "--steps", "5"]
    code = cli.main([*argv, "--problems-per-step", "1", "--group-size", "2"])

    assert code == 130
    assert calls == ["start", "stop"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["step_reached"] == 1 and summary["steps"] == 1
    assert isinstance(summary["eval_before"], float)
    assert summary["eval_after"] is None
    assert summary["first5"] is None and summary["last5"] is None  # 1 step: no windows
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (out / "timeline.png").stat().st_size > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    printed = capsys.readouterr()
    assert "interrupted after step 1 of 5" in printed.out
    assert str(out / "summary.json") in printed.out and str(out / "reward_curve.png") in printed.out
    assert "demo interrupted; stopping its stack" in printed.err


def test_ctrl_c_during_the_first_step_writes_a_summary_of_no_step(tmp_path, stub):
    _Stub.interrupt_at = 1  # step 1's first session: eval_before has ended, no step has
    try:
        cfg = DemoConfig(steps=3, problems_per_step=1, group_size=2)
        runner = DemoRunner(stub, stub, cfg, tmp_path, echo=lambda _: None)
        with pytest.raises(KeyboardInterrupt):
            runner.run()
    finally:
        _Stub.interrupt_at = 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["step_reached"] == 0
    assert summary["first5"] is None and summary["last5"] is None
    assert isinstance(summary["eval_before"], float)
    assert runner.interrupted is not None
    assert str(tmp_path / "reward_curve.png") in runner.interrupted["files"]
