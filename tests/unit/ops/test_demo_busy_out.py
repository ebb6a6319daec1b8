"""A second `flywheel demo` with the `--out` of a demo (or stack) that still runs is refused
with exit 2 and one line saying what runs there and how to stop it, before it deletes or
truncates anything: the running demo keeps its stack folder and its metrics.jsonl. The first
demo is a real `flywheel demo` process on a running stack (a stub gateway and engine over real
HTTP that never serve a new weight version, so it stays at step 3's wait); the stack of a demo
of its own is a real process holding `<out>/stack/stack.lock` through `Stack`'s own lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import flywheel.ops.stack as stack_module
from flywheel.ops import cli
from flywheel.ops.stack import STATE_FILE

from ..core.http_stub import JsonHandler, serving
from .demo_fakes import FakeService


class _Stub(JsonHandler):
    """Gateway and engine in one: /healthz, sessions, a chat turn answering "5", finish, and
    `/model_info` at weight version 0 forever."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/model_info":
            self._json(200, {"weight_version": "0"})
        elif self.path == "/healthz":
            self._json(200, {})
        else:
            self._json(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        port = self.server.server_address[1]  # type: ignore[index]
        if self.path == "/v1/sessions":
            sid = f"s{uuid.uuid4().hex[:8]}"
            self._json(200, {"session_id": sid, "base_url": f"http://127.0.0.1:{port}/s/{sid}/v1"})
        elif self.path.endswith("/chat/completions"):
            message = {"role": "assistant", "content": "5"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            reply = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m"}
            self._json(200, {**reply, "choices": [choice]})
        elif self.path.endswith("/finish"):
            self._json(200, {})
        else:
            self._json(404, {"error": {"message": "no such route"}})


def _wait_for(condition, what: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the first process exited ({proc.returncode}) before {what}:\n{out}{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _fake_stack(monkeypatch) -> list[str]:  # noqa: ANN001
    """A `Stack` fake recording its calls (the second demo must not get as far as starting)."""
    calls: list[str] = []

    class FakeStack:
        def __init__(self, settings, config_file=None):  # noqa: ANN001
            calls.append("init")
            self.services = [FakeService("gateway"), FakeService("engine")]
            self.redis, self.moved = None, {}

        def start(self) -> None:
            calls.append("start")

        def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr(stack_module, "Stack", FakeStack)
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    return calls


@pytest.mark.parametrize("new_stack", [False, True], ids=["running-stack", "new-stack"])
def test_a_second_demo_on_the_out_of_a_running_demo_is_refused_and_changes_nothing(
    tmp_path, monkeypatch, capsys, new_stack
):
    calls = _fake_stack(monkeypatch)
    out = tmp_path / "demo"
    with serving(_Stub) as url:
        state = tmp_path / "state"
        state.mkdir()
        stack = {"pid": os.getpid(), "gateway": url, "engine": url}
        (state / STATE_FILE).write_text(json.dumps(stack))
        trainer = {  # the running trainer's steps: the demo's groups fill them
            "batch": {"groups_per_step": 1, "group_size": 2},
            "logging": {"metrics_path": str(tmp_path / "trainer_metrics.jsonl")},
        }
        (state / "settings.json").write_text(json.dumps({"trainer": trainer}))
        env = {**os.environ, "FLYWHEEL_STATE_DIR": str(state)}
        argv = ["demo", "--out", str(out), "--steps", "5"]
        argv += ["--problems-per-step", "1", "--group-size", "2"]
        first = subprocess.Popen(
            [sys.executable, "-m", "flywheel.ops.cli", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            metrics = out / "metrics.jsonl"

            def two_steps() -> bool:
                return metrics.exists() and len(metrics.read_text().splitlines()) == 2

            _wait_for(two_steps, "its second step's row", first)
            # a stack folder the first demo's files live beside (here: its logs)
            (out / "stack" / "logs").mkdir(parents=True)
            (out / "stack" / "logs" / "engine.log").write_text("the first demo's log\n")
            rows = metrics.read_text()

            monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(state))
            ran: list[Path] = []  # a second run that did start is recorded, not run
            monkeypatch.setattr(
                "flywheel.ops.demo.runner.DemoRunner.run",
                lambda self, started_at=None: ran.append(self.out) or _SUMMARY,
            )
            code = cli.main([*argv, *(["--new-stack"] if new_stack else [])])

            err = capsys.readouterr().err
            assert code == 2, err
            assert err.strip().count("\n") == 0, err
            assert f"a demo (process {first.pid}) is running with --out {out}" in err, err
            assert "Ctrl-C where it runs" in err and "pass another --out" in err, err
            assert calls == [] and ran == []
            assert metrics.read_text() == rows  # not truncated
            assert (out / "stack" / "logs" / "engine.log").read_text() == "the first demo's log\n"
            assert first.poll() is None  # the first demo runs on
        finally:
            _stop(first)


_HOLD_STACK_LOCK = """
import json, os, sys, time
from pathlib import Path
from flywheel.core.settings import FlywheelSettings
from flywheel.ops.stack import STATE_FILE, Stack

stack = Stack(FlywheelSettings(state_dir=sys.argv[1]))
stack._lock_state_dir()  # as Stack.start does first
Path(sys.argv[1], STATE_FILE).write_text(json.dumps({"pid": os.getpid()}))
print("held", flush=True)
time.sleep(600)
"""


def test_a_demo_on_an_out_whose_stack_runs_is_refused_and_deletes_nothing(
    tmp_path, monkeypatch, capsys
):
    calls = _fake_stack(monkeypatch)
    out = tmp_path / "demo"
    stack_dir = out / "stack"
    (stack_dir / "checkpoints").mkdir(parents=True)
    (stack_dir / "checkpoints" / "step_1.pt").write_bytes(b"weights")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_STACK_LOCK, str(stack_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code = cli.main(["demo", "--new-stack", "--out", str(out), "--steps", "2"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"a stack is running from {stack_dir}" in err, err
        assert f"FLYWHEEL_STATE_DIR={stack_dir} flywheel down" in err, err
        assert calls == []
        assert (stack_dir / "checkpoints" / "step_1.pt").read_bytes() == b"weights"
        assert (stack_dir / STATE_FILE).exists() and (stack_dir / "stack.lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_out_of_a_demo_that_ended_is_used_again(tmp_path, monkeypatch, capsys):
    """The lock dies with its process: a demo killed outright does not block the next one."""
    calls = _fake_stack(monkeypatch)
    out = tmp_path / "demo"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from flywheel.ops.demo_cli import demo_folder\n"
            "with demo_folder(Path(sys.argv[1])) as refusal:\n"
            "    print(refusal, flush=True); time.sleep(600)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "None\n"
    holder.kill()
    holder.wait()
    monkeypatch.setattr(
        "flywheel.ops.demo.runner.DemoRunner.run", lambda self, started_at=None: _SUMMARY
    )
    code = cli.main(["demo", "--new-stack", "--out", str(out), "--steps", "2"])
    assert code == 0, capsys.readouterr().err
    assert calls == ["init", "start", "stop"]
    assert not Path(out / "demo.lock").exists()  # deleted by the demo that held it


_SUMMARY = {"first5": 0.2, "last5": 0.8, "eval_before": 0.5, "eval_after": 0.9, "steps": 2}
