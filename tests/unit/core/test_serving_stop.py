"""A service served by `core.serving.serve` and stopped (SIGTERM) while requests are in flight:
those still running after the grace period are answered 503 in the error JSON (a stream already
begun is cut off), and its log gets one line counting them: no traceback, no "Exception in ASGI
application", no 500. A real server process with a slow route and a streaming one."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from flywheel.core.redis_server import free_port

_SERVER = """
import asyncio, sys
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from flywheel.core.serving import serve

app = FastAPI()
begun = 0

@app.get("/healthz")
async def healthz():
    return {"begun": begun}

@app.post("/slow")
async def slow():
    global begun
    begun += 1
    await asyncio.sleep(600)

@app.get("/stream")
async def stream():
    global begun
    begun += 1

    async def chunks():
        yield b"data: first\\n\\n"
        await asyncio.sleep(600)

    return StreamingResponse(chunks(), media_type="text/event-stream")

serve(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info", grace_s=1)
"""

SLOW = 3


def _wait_begun(url: str, proc: subprocess.Popen, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(f"{url}/healthz", timeout=2).json()["begun"] >= count:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    pytest.fail(f"{count} requests did not begin within 60 s")


def test_requests_cancelled_by_a_stop_are_answered_503_and_logged_in_one_line():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    replies: list[httpx.Response | Exception] = []
    streamed: list[bytes | Exception] = []

    def slow() -> None:
        try:
            replies.append(httpx.post(f"{url}/slow", timeout=60))
        except httpx.HTTPError as exc:
            replies.append(exc)

    def stream() -> None:
        got = b""
        try:
            with httpx.stream("GET", f"{url}/stream", timeout=60) as reply:
                for chunk in reply.iter_raw():
                    got += chunk
            streamed.append(got)
        except httpx.HTTPError as exc:
            streamed.append(exc)

    try:
        _wait_begun(url, proc, 0)
        threads = [threading.Thread(target=slow) for _ in range(SLOW)]
        threads.append(threading.Thread(target=stream))
        for t in threads:
            t.start()
        _wait_begun(url, proc, SLOW + 1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        for t in threads:
            t.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert len(replies) == SLOW
    for reply in replies:
        assert isinstance(reply, httpx.Response), reply
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["type"] == "service_unavailable_error" and "stopping" in error["message"]
    assert len(streamed) == 1
    # the stream had begun: it is cut off (its connection closed), not completed
    assert isinstance(streamed[0], httpx.RemoteProtocolError), streamed[0]
    for noise in ("Traceback", "Exception in ASGI application", "CancelledError", " 500"):
        assert noise not in output, output
    assert "ERROR" not in output, output
    counted = [line for line in output.splitlines() if "in-flight request(s)" in line]
    assert len(counted) == 1, output
    assert f"cancelled {SLOW + 1} in-flight request(s) still running 1 s after" in counted[0]
