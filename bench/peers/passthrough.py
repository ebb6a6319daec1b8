"""A minimal pass-through OpenAI proxy (the floor any gateway is compared with): one raw ASGI
app on uvicorn that forwards POST /v1/chat/completions bodies to an upstream with a pooled
aiohttp client (the client the gateway's engine pool uses) and returns the answer as is.

    python bench/peers/passthrough.py --port 8123 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse

import aiohttp
import uvicorn


def make_app(upstream: str):
    upstream = upstream.rstrip("/")
    sessions: list[aiohttp.ClientSession] = []  # made on the server's event loop

    def client() -> aiohttp.ClientSession:
        if not sessions:
            sessions.append(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256),
                timeout=aiohttp.ClientTimeout(total=60)))
        return sessions[0]

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
            async with client().post(upstream + scope["path"], data=body,
                                     headers={"content-type": "application/json"}) as resp:
                status, data = resp.status, await resp.read()
                ctype = resp.headers.get("content-type", "application/json").encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvicorn.run(make_app(args.upstream), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
