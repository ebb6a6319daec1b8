"""A step whose every episode fails publishes no Sample, so the weight version the demo waits for
cannot come: the demo stops at once with how many failed, the first error and where the stack's
logs are, writes summary.json (`stopped`) like the interrupt path, and exits 1. Real HTTP: a stub
gateway answering every chat turn 502 and a stub engine at weight version 0; the stack's start
and stop are fakes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

import flywheel.ops.stack as stack_module
from flywheel.ops import cli
from flywheel.ops.demo import tasks_choice

from .test_demo_failed_episodes import _Gateway
from .test_demo_interrupt import _Stub

WAIT_S = 3600.0
"""The demo's `step_timeout_s` here: a demo that waited for the version the failed step cannot
bring would hang for an hour (pytest's timeout ends it first) instead of stopping at once."""


def _serve(handler: type) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


@pytest.fixture
def failing() -> Iterator[dict[str, str]]:
    """URLs of a gateway whose chat turns all fail (502) and of an engine at version 0."""
    gateway, gateway_url = _serve(_Gateway)
    engine, engine_url = _serve(_Stub)
    try:
        yield {"gateway": gateway_url, "engine": engine_url}
    finally:
        gateway.shutdown()
        engine.shutdown()


def test_a_step_whose_episodes_all_fail_stops_the_demo_with_its_first_error(
    monkeypatch, tmp_path, failing, capsys
):
    class Service:
        def __init__(self, name: str):
            self.name, self.url = name, failing[name]

    class FakeStack:
        def __init__(self, settings, config_file=None):  # noqa: ANN001
            self.services = [Service("gateway"), Service("engine")]
            self.redis, self.moved = None, {}  # every configured port was free

        def start(self) -> None: ...

        def stop(self) -> None: ...

    chosen = tasks_choice.demo_runner

    def long_wait(task, **settings):  # noqa: ANN001, ANN202
        runner_class, cfg = chosen(task, **settings)
        cfg.step_timeout_s = WAIT_S  # a demo waiting for the version would hang here
        return runner_class, cfg

    monkeypatch.setattr(stack_module, "Stack", FakeStack)
    monkeypatch.setattr(tasks_choice, "demo_runner", long_wait)
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    out = tmp_path / "demo"
    argv = ["demo", "--new-stack", "--out", str(out), "--steps", "3"]
    began = time.monotonic()
    code = cli.main([*argv, "--problems-per-step", "1", "--group-size", "2"])

    assert code == 1
    printed = capsys.readouterr()
    assert "did not reach weight version" not in printed.err, printed.err  # no wait timed out
    assert time.monotonic() - began < WAIT_S / 10  # it stopped; it did not wait for a version
    assert "all 2 episodes of step 1 failed" in printed.err, printed.err
    assert "failed on the server, scored 0: InternalServerError" in printed.err
    assert f"logs are in {out / 'stack' / 'logs'}" in printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False and "all 2 episodes of step 1" in summary["stopped"]
    assert summary["step_reached"] == 0 and summary["eval_after"] is None
    assert str(out / "summary.json") in printed.out and (out / "reward_curve.png").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["failed_episodes"]) for row in rows] == [(1, 2)]
