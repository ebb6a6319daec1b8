"""`flywheel demo` on a running stack (one `flywheel up` started, not the demo) stopped by a
signal while its episodes wait on the gateway: Ctrl-C (SIGINT) and SIGTERM both write
summary.json (interrupted) and the plots, print the one-line cancel message and exit promptly
with 128 + the signal's number (130, 143), no traceback. A real `flywheel demo` process against
a stub gateway and engine over real HTTP whose chat turns never answer: the episodes' requests
are still waiting when the demo exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from flywheel.ops.stack import STATE_FILE

from ..core.http_stub import JsonHandler

EXIT_BOUND_S = 15.0
"""Seconds the demo may take to exit after the signal: the episodes' requests wait 600 s."""


class _Silent(JsonHandler):
    """Gateway and engine in one: healthy, `/model_info` at weight version 0, sessions; a chat
    turn is held open, unanswered, until the server stops."""

    release = threading.Event()
    chats = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/healthz":
            self._json(200, {"status": "ok"})
        elif self.path == "/model_info":
            self._json(200, {"weight_version": "0"})
        else:
            self._json(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        port = self.server.server_address[1]  # type: ignore[index]
        if self.path == "/v1/sessions":
            sid = f"s{uuid.uuid4().hex[:8]}"
            self._json(200, {"session_id": sid, "base_url": f"http://127.0.0.1:{port}/s/{sid}/v1"})
        elif self.path.endswith("/chat/completions"):
            with self.lock:
                type(self).chats += 1
            self.release.wait()  # never answered while the demo runs
        else:
            self._json(200, {})


@pytest.fixture
def running_stack(tmp_path) -> Iterator[Path]:
    """A state dir naming the stub as a running stack (its pid: this process) whose trainer
    trains steps of 1 group of 2 rollouts."""
    _Silent.chats = 0
    _Silent.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway": url, "engine": url}))
    trainer = {
        "batch": {"group_size": 2, "groups_per_step": 1},
        "logging": {"metrics_path": str(tmp_path / "trainer" / "metrics.jsonl")},
    }
    (state / "settings.json").write_text(json.dumps({"trainer": trainer}))
    try:
        yield state
    finally:
        _Silent.release.set()
        server.shutdown()
        server.server_close()


def _demo(state: Path, out: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_STATE_DIR"] = str(state)
    argv = ["demo", "--out", str(out), "--steps", "3", "--problems-per-step", "1"]
    return subprocess.Popen(
        [sys.executable, "-m", "flywheel.ops.cli", *argv, "--group-size", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the signal goes to the demo only
    )


def _wait_for_two_chats(demo: subprocess.Popen[str]) -> float:
    """Wait until two of the demo's episodes wait on a chat turn; returns the deadline used."""
    deadline = time.monotonic() + 60
    while _Silent.chats < 2:
        assert demo.poll() is None, demo.communicate()
        assert time.monotonic() < deadline, "the demo's episodes never reached a chat turn"
        time.sleep(0.05)
    return deadline


def _stop_mid_episodes(demo: subprocess.Popen[str], signum: int) -> tuple[int, str, str]:
    """Wait until two episodes wait on a chat turn, send `signum`; returns the exit status,
    stdout and stderr (fails when the demo has not exited `EXIT_BOUND_S` after the signal)."""
    _wait_for_two_chats(demo)
    demo.send_signal(signum)
    try:
        out, err = demo.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        demo.kill()
        out, err = demo.communicate()
        pytest.fail(f"the demo had not exited {EXIT_BOUND_S} s after the signal:\n{out}\n{err}")
    return demo.returncode, out, err


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_writes_the_summary_and_exits_promptly(running_stack, tmp_path, signum, code):
    out = tmp_path / "demo"
    status, stdout, stderr = _stop_mid_episodes(_demo(running_stack, out), signum)
    assert status == code, (stdout, stderr)
    assert "Traceback" not in stderr and "Exception" not in stderr, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["step_reached"] == 0
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (out / "timeline.png").stat().st_size > 0
    assert "2 in-flight episodes cancelled" in stdout, stdout
    assert "interrupted after step 0 of 3" in stdout, stdout
    assert "demo interrupted; the running stack goes on" in stderr, stderr


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_second_signal_does_not_cut_the_summary_short(running_stack, tmp_path, signum, code):
    """Two Ctrl-Cs (or SIGTERMs) in quick succession: the second arrives while the demo writes
    its summary and draws the plots; it is not cut short: every file and line comes, no
    traceback (the demo ignores it, or says in one line that it is already stopping)."""
    out = tmp_path / "demo"
    demo = _demo(running_stack, out)
    deadline = _wait_for_two_chats(demo)
    demo.send_signal(signum)
    while not (out / "summary.json").exists():  # written first, then the plots are drawn
        assert time.monotonic() < deadline + EXIT_BOUND_S, "no summary.json after the signal"
        time.sleep(0.01)
    demo.send_signal(signum)
    try:
        stdout, stderr = demo.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        demo.kill()
        pytest.fail(f"the demo had not exited {EXIT_BOUND_S} s after the signals")
    assert demo.returncode == code, (stdout, stderr)
    assert "Traceback" not in stderr and "Exception" not in stderr, stderr
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (out / "timeline.png").stat().st_size > 0
    assert "2 in-flight episodes cancelled" in stdout, stdout
    assert "interrupted after step 0 of 3" in stdout, stdout
