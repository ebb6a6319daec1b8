"""An instant stub upstream for benchmarks and fault tests: SGLang `/generate` and OpenAI
`/v1/chat/completions` (plain and SSE), on asyncio streams with HTTP/1.1 keep-alive.

`python bench/peers/stub_upstream.py --port 0 --mode ok` prints `port N` once listening.
Modes (fault injection): ok | 500 (every call) | drop (headers + half a body, then close) |
garbage (200 with a non-JSON body) | hang (never answers) | slow (answers after `SLOW_S`, or
closes when its client leaves first) | trickle (`/generate` streams its first token at once and
its final chunk after `SLOW_S`, or closes when its client leaves first). `GET /stats` returns
the number of generate/chat calls (`calls`) and of slow or trickle calls whose client left
(`dropped`), so tests can check what reached the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

OUTPUT_IDS = [28, 2]
"""Token ids of every stub generation: one token, then EOS (id 2 in SmolLM2's vocabulary)."""
SLOW_S = 3.0
"""Seconds a `slow` stub takes to answer."""


def generate_body(prompt_len: int) -> dict:
    return {
        "text": "8",
        "output_ids": OUTPUT_IDS,
        "meta_info": {
            "id": "stub",
            "prompt_tokens": prompt_len,
            "completion_tokens": len(OUTPUT_IDS),
            "output_token_logprobs": [[-0.25, OUTPUT_IDS[0], None], [-0.5, OUTPUT_IDS[1], None]],
            "finish_reason": {"type": "stop", "matched": OUTPUT_IDS[-1]},
            "weight_version": "default",
        },
    }


def chat_body(model: str) -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": None,
                "message": {"role": "assistant", "content": "8"},
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }


def sse_chunks(model: str) -> bytes:
    base = {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    events = [
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {"content": "8"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    return (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )


class Stub:
    def __init__(self, mode: str):
        self.mode = mode
        self.calls = 0
        self.dropped = 0
        """Requests whose client closed the connection while the stub waited (`slow`)."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.lower(): v.strip()
                    for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                if not await self.respond(method, path, body, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def respond(
        self,
        method: str,
        path: str,
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Write one response; False = close the connection."""
        if path in ("/health", "/health_generate", "/v1/models", "/stats"):
            payload = (
                {"calls": self.calls, "dropped": self.dropped}
                if path == "/stats"
                else {"object": "list", "data": [{"id": "stub", "object": "model"}]}
            )
            return await self.send(writer, 200, json.dumps(payload).encode())
        if method != "POST" or path not in (
            "/generate",
            "/v1/chat/completions",
            "/chat/completions",
        ):
            return await self.send(writer, 404, b'{"error": "not found"}')
        self.calls += 1
        if self.mode == "trickle" and path == "/generate":
            return await self.trickle(json.loads(body or b"{}"), reader, writer)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "slow" and await self.client_left(reader):  # answers after SLOW_S
            return False
        if self.mode == "500":
            return await self.send(writer, 500, b'{"error": "stub failure"}')
        if self.mode == "garbage":
            return await self.send(writer, 200, b"<html>not json")
        req = json.loads(body or b"{}")
        if path == "/generate":
            out = json.dumps(generate_body(len(req.get("input_ids") or []))).encode()
        elif req.get("stream"):
            return await self.send(
                writer, 200, sse_chunks(req.get("model", "stub")), "text/event-stream"
            )
        else:
            out = json.dumps(chat_body(req.get("model", "stub"))).encode()
        if self.mode == "drop":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(out) + out[: len(out) // 2]
            )
            await writer.drain()
            return False
        return await self.send(writer, 200, out)

    async def client_left(self, reader: asyncio.StreamReader) -> bool:
        """Wait SLOW_S; True (counted in `dropped`) when the client closed the connection
        first."""
        try:
            if await asyncio.wait_for(reader.read(1), SLOW_S) == b"":
                self.dropped += 1
                return True
        except TimeoutError:
            pass
        return False

    async def trickle(
        self, req: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """`/generate` with `stream`: the first token's cumulative chunk at once, the final
        chunk after SLOW_S unless the client leaves first (counted in `dropped`)."""
        final = generate_body(len(req.get("input_ids") or []))
        meta = final["meta_info"]
        first = {
            "text": final["text"],
            "output_ids": OUTPUT_IDS[:1],
            "meta_info": {
                **meta,
                "completion_tokens": 1,
                "finish_reason": None,
                "output_token_logprobs": meta["output_token_logprobs"][:1],
            },
        }
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"connection: close\r\n\r\ndata: " + json.dumps(first).encode() + b"\n\n"
        )
        await writer.drain()
        if await self.client_left(reader):
            return False
        writer.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
        await writer.drain()
        return False

    @staticmethod
    async def send(
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str = "application/json",
    ) -> bool:
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        return True


async def serve(port: int, mode: str) -> None:
    stub = Stub(mode)
    server = await asyncio.start_server(stub.handle, "127.0.0.1", port, backlog=1024)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--mode", default="ok", choices=["ok", "500", "drop", "garbage", "hang", "slow", "trickle"]
    )
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.mode))


if __name__ == "__main__":
    main()
