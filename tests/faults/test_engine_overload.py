"""A full engine queue seen through real processes: an embedded engine (`python -m
flywheel.engine`, the tiny model) running one row with room for one more
(`max_batch_size = 1`, `max_queued_requests = 1`), and a real gateway process in front of it.
The two rows could run for minutes (a 65536-token window), so neither ends before the checks;
they are aborted after.

While the engine is full, a request is answered at once (seconds, not the engine call's 300 s
timeout) with 503 and Retry-After, in each API's error format (OpenAI JSON for chat, streamed
chat and Responses; Anthropic JSON `overloaded_error` for Messages), the engine stays in service,
and the request is served once the queue has room."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 4}
LONG_ROW = {
    "input_ids": [1, 2, 3, 4],
    "sampling_params": {"max_new_tokens": 65000, "ignore_eos": True, "temperature": 1.0},
}


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


def test_a_full_engine_queue_is_a_fast_503_with_retry_after_on_every_api(
    procs, redis_server, prefix, tiny_model_dir
):
    with engine_process(
        tiny_model_dir,
        max_batch_size="1",
        max_queued_requests="1",
        context_length="65536",
        allow_longer_context="true",
    ) as engine:
        gw = procs.gateway(redis_server.url, prefix, [engine], tiny_model_dir)
        rows = [
            threading.Thread(
                target=httpx.post,
                args=(f"{engine}/generate",),
                kwargs={"json": {**LONG_ROW, "rid": f"long-{i}"}, "timeout": 600},
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 60
        rows[0].start()  # runs
        while _metric(engine, "flywheel_engine_generated_tokens_total") < 1:
            assert time.monotonic() < deadline, "the first row never ran"
            time.sleep(0.05)
        rows[1].start()  # waits: the queue is full
        while _metric(engine, "flywheel_engine_queue_depth") < 1:
            assert time.monotonic() < deadline, "the second row never queued"
            time.sleep(0.05)
        # the engine itself refuses a third row at once
        direct = httpx.post(f"{engine}/generate", json=LONG_ROW, timeout=30)
        assert direct.status_code == 503, direct.text
        assert "queue is full" in direct.json()["error"]["message"]

        with httpx.Client(base_url=gw, timeout=60) as client:
            cases = [
                ("/v1/chat/completions", CHAT),
                ("/v1/chat/completions", {**CHAT, "stream": True}),
                ("/v1/responses", {"model": "m", "input": "7 + 1?", "max_output_tokens": 4}),
            ]
            for path, body in cases:
                t0 = time.monotonic()
                reply = client.post(path, json=body)
                took = time.monotonic() - t0
                assert reply.status_code == 503, (path, reply.text)
                assert took < 10, took  # not the engine call's timeout
                assert int(reply.headers["retry-after"]) >= 1
                error = reply.json()["error"]
                assert error["type"] == "service_unavailable"
                assert error["code"] == "engine_overloaded"
                assert "queue is full" in error["message"]
            messages = client.post(
                "/v1/messages",
                json={
                    "model": "m",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert messages.status_code == 503, messages.text
            assert int(messages.headers["retry-after"]) >= 1
            assert messages.json()["type"] == "error"
            assert messages.json()["error"]["type"] == "overloaded_error"

            assert _metric(engine, "flywheel_engine_queue_rejected_total") >= 5
            assert _metric(gw, "flywheel_gateway_engine_busy_total") >= 4
            assert _metric(gw, "flywheel_gateway_engine_up") == 1  # busy, not taken out

            # a 2-layer model needs minutes for 65000 tokens: the rows are still there to abort
            assert rows[0].is_alive() and rows[1].is_alive()
            httpx.post(f"{engine}/abort_request", json={"rid": "long-"}, timeout=30)
            for row in rows:
                row.join(60)
                assert not row.is_alive()
            served = client.post("/v1/chat/completions", json=CHAT)
            assert served.status_code == 200, served.text
