"""An engine killed while it serves a call resets the connection; the client's error says so in
words ("the engine reset the connection (did it exit?)", "the engine's answer broke off before
its end"), never as aiohttp's exception (`ClientOSError: [Errno 104] ...`) nor with the engine's
address. The stub engine is a loopback socket that reads the request, writes `MOMENTS[moment]`
and closes with a reset (SO_LINGER 0)."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import threading
from collections.abc import Iterator

import aiohttp
import pytest

from flywheel.core.errors import PlatformError
from flywheel.gateway.engines.call_errors import describe
from flywheel.gateway.engines.pool import EnginePool

from .harness import gateway_app
from .test_request_rules import renderer  # noqa: F401  (fixture)

EVENT = b'data: {"text": "8", "output_ids": [28], "meta_info": {}}\n\n'
MOMENTS = {
    "before the answer": b"",
    "in the answer": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        b'{"text": "8", '
    ),
    "in the stream": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
    ),
}


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)


@pytest.fixture
def resetting_engine(request) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(URL, {"answer": bytes}): every connection gets `answer` written, then a reset."""
    server = socket.create_server(("127.0.0.1", 0))
    state = {"answer": b""}

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed at teardown
            try:
                _read_request(conn)
                if state["answer"]:
                    conn.sendall(state["answer"])
            except OSError:
                pass
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", state
    server.close()


def _in_words(message: str) -> None:
    for part in ("Error", "Errno", "<", "127.0.0.1", "http://"):
        assert part not in message, message


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_reset_by_the_engine_is_told_in_words(resetting_engine, moment, streamed):
    url, state = resetting_engine
    state["answer"] = MOMENTS[moment]

    async def run() -> PlatformError:
        pool = EnginePool([url], 5.0, {2}, health_interval_s=0)
        try:
            with pytest.raises(PlatformError) as info:
                if streamed:
                    await pool.generate_stream([1], {"max_new_tokens": 2}, "x", on_text=len)
                else:
                    await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        finally:
            await pool.aclose()
        return info.value

    err = asyncio.run(run())
    assert err.http_status == 502, err.message
    _in_words(err.message)
    if moment == "before the answer":
        assert "engine 1: the engine reset the connection (did it exit?)" in err.message
    else:
        assert "the engine's answer broke off before its end" in err.message


def test_the_client_body_of_a_reset_is_words(resetting_engine, redis_client, prefix, renderer):
    url, _ = resetting_engine
    pool = EnginePool([url], 5.0, {2}, health_interval_s=0)
    client, _, _ = gateway_app(redis_client, prefix, renderer, pool)
    user = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"model": "m", "messages": user})
    msg = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": user})
    assert chat.status_code == 502 and "error" in chat.json(), chat.text
    assert msg.status_code == 502 and msg.json()["type"] == "error", msg.text
    for resp in (chat, msg):
        _in_words(resp.text)
        assert "the engine reset the connection" in resp.text, resp.text


@pytest.mark.parametrize(
    ("exc", "phrase"),
    [
        (aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"), "reset"),
        (aiohttp.ClientOSError(errno.EPIPE, "Broken pipe"), "reset"),
        (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), "reset"),
        (aiohttp.ClientOSError(errno.EHOSTUNREACH, "No route to host"), "No route to host"),
        (aiohttp.ConnectionTimeoutError("Connection timeout to host http://10.0.0.7:30000"), ""),
        (aiohttp.ClientPayloadError("Response payload is not completed: <X>"), "broke off"),
        (aiohttp.ClientResponseError(None, (), status=500), "failed"),  # type: ignore[arg-type]
    ],
)
def test_describe_names_no_exception_type(exc, phrase):
    text = describe(exc)
    _in_words(text)
    assert "10.0.0.7" not in text and phrase in text, text
