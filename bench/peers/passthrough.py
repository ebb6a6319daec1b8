"""A minimal pass-through OpenAI proxy (the floor any gateway is compared with): one raw ASGI
app on uvicorn that forwards POST bodies to an upstream with a pooled HTTP client and returns
the answer as is.

    python bench/peers/passthrough.py --port 8123 --upstream http://127.0.0.1:9000 \\
        [--client aiohttp|httpx]

`aiohttp` (default) is the client the gateway's engine pool uses; `httpx` is the one the openai
SDK and most Python proxies are built on, for reference.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import uvicorn

Forward = Callable[[str, bytes], Awaitable[tuple[int, bytes, bytes]]]


def aiohttp_forward(upstream: str) -> Forward:
    sessions: list[aiohttp.ClientSession] = []  # made on the server's event loop

    async def forward(path: str, body: bytes) -> tuple[int, bytes, bytes]:
        if not sessions:
            sessions.append(
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=256),
                    timeout=aiohttp.ClientTimeout(total=60),
                )
            )
        async with sessions[0].post(
            upstream + path, data=body, headers={"content-type": "application/json"}
        ) as resp:
            return (
                resp.status,
                await resp.read(),
                resp.headers.get("content-type", "application/json").encode(),
            )

    return forward


def httpx_forward(upstream: str) -> Forward:
    client = httpx.AsyncClient(
        base_url=upstream,
        timeout=60,
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
    )

    async def forward(path: str, body: bytes) -> tuple[int, bytes, bytes]:
        resp = await client.post(path, content=body, headers={"content-type": "application/json"})
        return (
            resp.status_code,
            resp.content,
            resp.headers.get("content-type", "application/json").encode(),
        )

    return forward


def make_app(upstream: str, client: str = "aiohttp"):
    forward = (aiohttp_forward if client == "aiohttp" else httpx_forward)(upstream.rstrip("/"))

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/health":
            status, data, ctype = 200, b"ok", b"text/plain"
        else:
            status, data, ctype = await forward(scope["path"], body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(data)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": data})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.upstream, args.client),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
