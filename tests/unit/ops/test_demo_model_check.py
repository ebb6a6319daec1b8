"""`flywheel demo` on a gateway that does not serve its model (`[gateway] served_model_names`
without it) is refused before the first step (exit 2, naming the served models and what to
set), not run into one 404 per episode; an evaluation whose every episode failed is written as
not measured (null), never as an accuracy of 0.0; and the lines of episodes failing at once on
the pool's threads never run together.

A real `flywheel demo` process against a stub gateway over real HTTP that answers as the
gateway does with served_model_names = ["qwen3-8b"]: `GET /v1/models` lists it, and a chat
request for another model is 404 `model_not_found`."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from flywheel.ops.demo.runner import DemoConfig, DemoRunner
from flywheel.ops.stack import STATE_FILE

from ..core.http_stub import JsonHandler, serving


class _ServesQwen(JsonHandler):
    """A gateway serving only "qwen3-8b"; `any_name`: one with no served_model_names."""

    any_name = False

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "qwen3-8b", "object": "model"}]})
        else:
            self._json(200, {"status": "ok", "weight_version": "0"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        chat = self.path.endswith("/chat/completions")
        if chat and body.get("model") != "qwen3-8b" and not self.any_name:
            message = f"The model `{body.get('model')}` does not exist"
            self._json(404, {"error": {"message": message, "code": "model_not_found"}})
            return
        self._json(400, {"error": {"message": "messages[0].content is missing", "code": None}})


@pytest.fixture
def gateway() -> Iterator[str]:
    _ServesQwen.any_name = False
    with serving(_ServesQwen) as url:
        yield url


def test_the_demo_refuses_a_gateway_that_does_not_serve_its_model(gateway, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE).write_text(
        json.dumps({"pid": os.getpid(), "gateway": gateway, "engine": gateway})
    )
    batch = {"group_size": 2, "groups_per_step": 1}
    (state / "settings.json").write_text(json.dumps({"trainer": {"batch": batch}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_STATE_DIR"] = str(state)
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--problems-per-step", "1", "--group-size", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "flywheel.ops.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "does not serve the demo's model 'SmolLM2-135M-Instruct'" in run.stderr, run.stderr
    assert '"qwen3-8b"' in run.stderr and "served_model_names" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "episode" not in run.stdout, run.stdout
    assert not (out / "summary.json").exists()


def test_a_gateway_serving_any_name_is_not_refused(gateway, tmp_path):
    _ServesQwen.any_name = True  # lists its model_name, accepts every name
    runner = DemoRunner(gateway, gateway, DemoConfig(), tmp_path / "demo")
    assert runner.access_refusal() is None


def test_an_evaluation_whose_every_episode_failed_is_not_written_as_measured(tmp_path):
    runner = DemoRunner("http://gateway.invalid", "http://engine.invalid", DemoConfig(), tmp_path)
    request = httpx.Request("POST", "http://gateway.invalid/v1/sessions")
    refused = httpx.Response(404, json={"error": {"message": "no"}}, request=request)

    def open_session(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise httpx.HTTPStatusError("404", request=request, response=refused)

    runner.open_session = open_session  # type: ignore[method-assign]
    lines: list[str] = []
    runner.echo = lines.append
    runner.out.mkdir(exist_ok=True)
    assert runner._timed_evaluate(0) is None
    assert 0 not in runner.eval_points
    assert any("not measured" in line for line in lines), lines
    summary = runner.write_interrupted(0.0)
    assert summary["eval_before"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["eval_before"] is None


def test_lines_echoed_from_many_threads_at_once_each_end_with_a_newline(monkeypatch, tmp_path):
    """Each write reaches the file at once (as on a pipe), letting other threads in between."""
    path = tmp_path / "console.txt"
    console = io.TextIOWrapper(open(path, "wb", buffering=0), write_through=True)  # noqa: SIM115
    monkeypatch.setattr(sys, "stdout", console)
    runner = DemoRunner("http://gateway.invalid", "http://engine.invalid", DemoConfig(), tmp_path)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [
            threading.Thread(
                target=lambda i=i: [runner.echo(f"episode {i} failed") for _ in range(1000)]
            )
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        monkeypatch.undo()
        console.close()
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 8 * 1000 + 1
    run_together = [ln for ln in lines[:-1] if not re.fullmatch(r"episode \d failed", ln)]
    assert not run_together, run_together[:5]
