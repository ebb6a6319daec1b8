"""An episode the gateway keeps failing (502) is retried by the openai client, then scored 0,
counted and logged; the demo run goes on (ops/demo/runner.py). Real HTTP to a stub gateway."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import ThreadingHTTPServer

from flywheel.ops.demo.runner import DemoConfig, DemoRunner
from flywheel.ops.demo.tasks import Problem

from ..core.http_stub import JsonHandler


class _Gateway(JsonHandler):
    """Creates sessions, answers every chat turn 502 (as an overloaded engine pool does) and
    records each finish body."""

    chat_calls = 0
    finished: list[tuple[str, dict]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        port = self.server.server_address[1]  # type: ignore[index]
        if self.path == "/v1/sessions":
            with self.lock:
                sid = f"s{uuid.uuid4().hex[:8]}"
            base = f"http://127.0.0.1:{port}/s/{sid}/v1"
            self._json(200, {"session_id": sid, "base_url": base})
        elif self.path.endswith("/chat/completions"):
            with self.lock:
                type(self).chat_calls += 1
            error = {"message": "no engine could serve the request: TimeoutError()"}
            self._json(502, {"error": error}, {"retry-after-ms": "1"})
        elif self.path.endswith("/finish"):
            with self.lock:
                self.finished.append((self.path.split("/")[3], body))
            self._json(200, {})
        else:
            self._json(404, {})


def test_a_502_episode_is_retried_then_scored_0_and_counted(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lines: list[str] = []
    cfg = DemoConfig(steps=1, problems_per_step=1, group_size=2)
    runner = DemoRunner(
        f"http://127.0.0.1:{server.server_port}",
        "http://engine.invalid",
        cfg,
        tmp_path,
        lines.append,
    )
    try:
        rewards = runner.rollouts([Problem(2, 3)])
    finally:
        server.shutdown()
    assert rewards == [0.0, 0.0]
    assert runner.failed == 2  # the step row's failed_episodes
    assert _Gateway.chat_calls == 2 * 6  # each episode: 1 try + 5 retries by the openai client
    assert sorted(body["reward"] for _, body in _Gateway.finished) == [0.0, 0.0]
    failed = [line for line in lines if "failed on the server, scored 0" in line]
    assert len(failed) == 2 and "InternalServerError" in failed[0], lines
