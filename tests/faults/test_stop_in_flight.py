"""A gateway or engine process stopped (SIGTERM: `flywheel down`, a demo's Ctrl-C) with requests
in flight: after the 5 s grace period the ones still running are answered 503 in the error JSON,
and the service's log gets one line counting them, not a traceback per request ("Exception in
ASGI application", CancelledError), a 500 per request, nor uvicorn's ERROR "Cancel N running
task(s)". Real processes: a gateway with Redis and a hanging stub engine; an embedded engine on
the tiny model whose generations wait behind a pause."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil

from tests.engine_process import engine_process

from .conftest import wait_http

TURNS = 3
CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}


def test_turns_in_flight_at_a_stop_are_answered_503_and_counted_in_one_log_line(
    procs, redis_server, prefix, tiny_model_dir
):
    engine = procs.stub("hang")
    url = procs.gateway(redis_server.url, prefix, [engine], tiny_model_dir)
    gateway = procs.procs[-1]
    log = procs.tmp / f"gateway-{url.rsplit(':', 1)[1]}.log"
    replies: list[httpx.Response | Exception] = []

    def turn(i: int) -> None:
        try:
            replies.append(
                httpx.post(
                    f"{url}/v1/chat/completions",
                    json=CHAT,
                    headers={"X-Session-Id": f"{prefix}-stop-{i}"},
                    timeout=120,
                )
            )
        except httpx.HTTPError as exc:
            replies.append(exc)

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(TURNS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while procs.calls(engine) < TURNS:  # every turn waits on the engine
        assert time.monotonic() < deadline, f"{procs.calls(engine)} of {TURNS} turns reached it"
        time.sleep(0.05)
    wait_http(f"{url}/healthz", 5)
    gateway.send_signal(signal.SIGTERM)
    gateway.wait(timeout=60)
    for t in threads:
        t.join(timeout=30)

    output = log.read_text()
    assert len(replies) == TURNS, replies
    for reply in replies:
        assert isinstance(reply, httpx.Response), reply
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["type"] == "service_unavailable_error" and "stopping" in error["message"]
    for noise in ("Traceback", "Exception in ASGI application", "CancelledError", "ERROR"):
        assert noise not in output, output
    counted = [line for line in output.splitlines() if "in-flight request(s)" in line]
    assert len(counted) == 1, output
    assert f"cancelled {TURNS} in-flight request(s) still running 5 s after" in counted[0]


def test_generations_in_flight_at_an_engine_stop_are_answered_503_and_counted_in_one_line(
    tmp_path, tiny_model_dir
):
    log = tmp_path / "engine.log"
    replies: list[httpx.Response | Exception] = []

    def generate(url: str) -> None:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
        try:
            replies.append(httpx.post(f"{url}/generate", json=body, timeout=120))
        except httpx.HTTPError as exc:
            replies.append(exc)

    with engine_process(tiny_model_dir, log_path=log) as url:
        proc_pid = _listener_pid(url)
        # paused, the engine accepts the rows and holds them: they stay in flight
        paused = httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=30)
        assert paused.status_code == 200, paused.text
        threads = [threading.Thread(target=generate, args=(url,)) for _ in range(TURNS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        queued = f"flywheel_engine_queue_depth {float(TURNS)}"
        while queued not in httpx.get(f"{url}/metrics", timeout=10).text:
            assert time.monotonic() < deadline, f"no {queued} within 60 s"
            time.sleep(0.05)
        os.kill(proc_pid, signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
    output = log.read_text()
    assert len(replies) == TURNS, replies
    for reply in replies:
        assert isinstance(reply, httpx.Response), reply
        assert reply.status_code == 503, reply.text
        assert "stopping" in reply.json()["error"]["message"]
    for noise in ("Traceback", "Exception in ASGI application", "CancelledError", " 500"):
        assert noise not in output, output
    counted = [line for line in output.splitlines() if "in-flight request(s)" in line]
    assert len(counted) == 1, output
    assert f"cancelled {TURNS} in-flight request(s) still running 5 s after" in counted[0]


def _listener_pid(url: str) -> int:
    """The process listening on `url`'s port (the engine)."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"nothing listens on port {port}")
