"""A minimal pass-through OpenAI proxy (the floor any gateway is compared with): one raw ASGI
app on uvicorn that forwards POST /v1/chat/completions bodies to an upstream with a pooled
httpx client and returns the answer as is.

    python bench/peers/passthrough.py --port 8123 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse

import httpx
import uvicorn


def make_app(upstream: str):
    client = httpx.AsyncClient(base_url=upstream, timeout=60,
                               limits=httpx.Limits(max_connections=256,
                                                   max_keepalive_connections=256))

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
            resp = await client.post(scope["path"], content=body,
                                     headers={"content-type": "application/json"})
            status, data = resp.status_code, resp.content
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
