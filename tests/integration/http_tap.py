"""A pass-through HTTP proxy for client tests: forwards every request to an upstream URL over
real HTTP (streamed answers stay streamed) and keeps, per request, the method, path, body size,
status and, for errors, the answer's first bytes. A test points a client it did not write (an npm
CLI, say) at `tap.url` to see exactly what that client sent and what the gateway answered."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    request_bytes: int
    request_json: bytes
    status: int = 0
    error_body: str = ""


@dataclass
class Tap:
    url: str
    exchanges: list[Exchange] = field(default_factory=list)

    def errors(self) -> list[Exchange]:
        """Exchanges the upstream answered with a status of 400 or more."""
        return [e for e in self.exchanges if e.status >= 400]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def http_tap(upstream: str) -> Iterator[Tap]:
    """Run a proxy to `upstream` (e.g. "http://127.0.0.1:8810") on a free loopback port.

    Yields the Tap; its `exchanges` fill as requests complete. The server stops on exit.
    Raises:
        TimeoutError: the proxy did not start within 10 s.
    """
    port = _free_port()
    tap = Tap(url=f"http://127.0.0.1:{port}")
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(600.0))

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        exchange = Exchange(request.method, request.url.path, len(body), body)
        tap.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream_request = client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            headers=headers,
            content=body,
        )
        answer = await client.send(upstream_request, stream=True)
        exchange.status = answer.status_code

        async def relay() -> AsyncIterator[bytes]:
            seen = b""
            async for chunk in answer.aiter_raw():
                if answer.status_code >= 400 and len(seen) < 2000:
                    seen += chunk
                yield chunk
            exchange.error_body = seen.decode("utf-8", "replace")[:2000]

        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(
            relay(), answer.status_code, kept, background=BackgroundTask(answer.aclose)
        )

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("the HTTP tap did not start within 10 s")
        time.sleep(0.02)
    try:
        yield tap
    finally:
        server.should_exit = True
        thread.join(timeout=10)
