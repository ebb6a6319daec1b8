"""Engine failures reach the client without the engines' internal addresses: when no engine
serves a call (busy, failed, refused, timed out; plain or streamed) the client's message names
the engines "engine 1", "engine 2", and the gateway's log line keeps their URLs. Engines are
real HTTP servers on loopback; the last test goes through the gateway app (chat and Messages
error JSON)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from aiohttp import web

from flywheel.core.errors import PlatformError
from flywheel.gateway.engines.client_text import without_urls
from flywheel.gateway.engines.pool import EnginePool

from .harness import gateway_app
from .test_engine_pool import serve
from .test_request_rules import renderer  # noqa: F401  (fixture)


def test_without_urls_names_engines_by_their_place():
    lines = [
        "http://127.0.0.1:30000: HTTP 503 busy",
        "https://engine-b.internal:8443/generate: no answer within 5 s",
        "http://127.0.0.1:30000: connection refused",
    ]
    assert without_urls(lines) == [
        "engine 1: HTTP 503 busy",
        "engine 2: no answer within 5 s",
        "engine 1: connection refused",
    ]


async def _status(status: int):
    async def answer(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(status=500)
        await request.read()
        return web.json_response({"error": {"message": f"engine says {status}"}}, status=status)

    return await serve(answer)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("status", [503, 500, None])  # busy, failed, nothing listening
def test_no_engine_served_names_no_engine_address(streamed, status, caplog):
    async def run():
        runners, urls = [], []
        for _ in range(2):
            runner, url = await _status(status or 500)
            runners.append(runner)
            urls.append(url)
        if status is None:  # both stopped: connection refused
            for runner in runners:
                await runner.cleanup()
        pool = EnginePool(urls, 5.0, {2}, health_interval_s=0)
        try:
            with pytest.raises(PlatformError) as info:
                if streamed:
                    await pool.generate_stream([1], {"max_new_tokens": 2}, "x", on_text=print)
                else:
                    await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        finally:
            await pool.aclose()
            if status is not None:
                for runner in runners:
                    await runner.cleanup()
        return urls, info.value

    with caplog.at_level(logging.WARNING):
        urls, err = asyncio.run(run())
    message = err.message
    assert "http://" not in message and "127.0.0.1" not in message, message
    assert "engine 1: " in message and "engine 2: " in message, message
    if status == 503:
        assert err.http_status == 503 and "engine says 503" in message  # the engine's reason
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert all(url in logged for url in urls), logged  # the details stay in the log


class _Busy(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802  (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"error": {"message": "queue full"}}).encode()
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_client_error_bodies_hold_no_engine_address(redis_client, prefix, renderer, caplog):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        pool = EnginePool([url], 5.0, {2}, health_interval_s=0)
        client, _, _ = gateway_app(redis_client, prefix, renderer, pool)
        user = [{"role": "user", "content": "hi"}]
        with caplog.at_level(logging.WARNING):
            chat = client.post("/v1/chat/completions", json={"model": "m", "messages": user})
            msg = client.post(
                "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": user}
            )
        assert chat.status_code == msg.status_code == 503, (chat.text, msg.text)
        assert chat.json()["error"]["code"] == "engine_overloaded"
        assert msg.json()["type"] == "error"
        for resp in (chat, msg):
            assert "127.0.0.1" not in resp.text and "http://" not in resp.text, resp.text
            assert "queue full" in resp.text  # the engine's own reason is kept
        assert url in "\n".join(r.getMessage() for r in caplog.records)
    finally:
        server.shutdown()
