"""Request limits and bad input: every case gets a 4xx OpenAI error body, nothing is a 500.

One table of (name, path, raw body or JSON, expected status, expected error code or None); the
gateway runs with a canned engine (real tokenizer, real Redis) and small limits.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from flywheel.gateway.engines.generation import Generation

MSG = [{"role": "user", "content": "What is 7 + 1?"}]
LIMITS = {
    "max_body_bytes": 64 * 1024,
    "max_messages": 8,
    "max_tools": 4,
    "max_tools_bytes": 2048,
    "max_json_depth": 16,
}


def _chat(**extra):
    return {"model": "m", "messages": MSG, **extra}


def _nested(depth: int) -> str:
    return '{"model":"m","messages":[{"role":"user","content":' + "[" * depth + "]" * depth + "}]}"


def _tool(i: int, props: int = 1) -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"f{i}",
            "parameters": {
                "type": "object",
                "properties": {f"p{j}": {"type": "string"} for j in range(props)},
            },
        },
    }


CHAT = "/v1/chat/completions"
CASES = [
    # (name, path, body (bytes = raw), status, error code)
    ("body over the size limit", CHAT, _chat(pad="x" * 70_000), 413, "request_too_large"),
    ("malformed JSON", CHAT, b'{"model": "m", "messages": [', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("JSON array instead of object", CHAT, b"[]", 400, None),
    ("JSON null", CHAT, b"null", 400, None),
    (
        "invalid UTF-8",
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}',
        400,
        "invalid_encoding",
    ),
    (
        "lone surrogate escape",
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"\\ud800 hi"}]}',
        400,
        "invalid_encoding",
    ),
    (
        "BOM before a lone surrogate",
        CHAT,
        b'\xef\xbb\xbf{"model":"m","messages":[{"role":"user","content":"\\ud800 hi"}]}',
        400,
        "invalid_encoding",
    ),
    (
        "BOM before too many messages",
        CHAT,
        b"\xef\xbb\xbf" + json.dumps(_chat(messages=MSG * 9)).encode(),
        400,
        "too_many_messages",
    ),
    (
        "NUL and control characters",
        CHAT,
        _chat(messages=[{"role": "user", "content": "a\u0000b\u001b[2J"}]),
        200,
        None,
    ),
    (
        "NaN temperature",
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
        400,
        "invalid_number",
    ),
    # Python's json reads these, JSON has no such numbers: a stored record would hold null
    (
        "Infinity in a message's extra field",
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"x","score":Infinity}]}',
        400,
        "invalid_number",
    ),
    (
        "a number beyond a double in a message",
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"x","name":1e999}]}',
        400,
        "invalid_number",
    ),
    (
        "NaN in session task metadata",
        "/v1/sessions",
        b'{"task":{"answer":8,"weight":NaN}}',
        400,
        "invalid_number",
    ),
    ("messages is a string", CHAT, _chat(messages="hello"), 400, None),
    ("no messages", CHAT, _chat(messages=[]), 400, None),
    ("unknown role", CHAT, _chat(messages=[{"role": "root", "content": "x"}]), 400, None),
    ("content is a number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, None),
    (
        "content part is not an object",
        CHAT,
        _chat(messages=[{"role": "user", "content": ["a"]}]),
        400,
        None,
    ),
    ("temperature is a string", CHAT, _chat(temperature="hot"), 400, None),
    ("max_tokens negative", CHAT, _chat(max_tokens=-1), 400, None),
    ("max_tokens beyond int64", CHAT, _chat(max_tokens=2**70), 400, None),
    ("n too large", CHAT, _chat(n=1000), 400, None),
    ("too many stop strings", CHAT, _chat(stop=[f"s{i}" for i in range(100)]), 400, None),
    ("too many messages", CHAT, _chat(messages=MSG * 9), 400, "too_many_messages"),
    ("too many tools", CHAT, _chat(tools=[_tool(i) for i in range(5)]), 400, "too_many_tools"),
    ("huge tool schema", CHAT, _chat(tools=[_tool(0, props=200)]), 400, "tools_too_large"),
    ("tool is not an object", CHAT, _chat(tools=["x"]), 400, None),
    ("nesting just over the limit", CHAT, _nested(16), 400, "json_too_deep"),
    ("nesting 30000 deep", CHAT, _nested(30_000), 400, "json_too_deep"),
    ("context window exceeded", CHAT, _chat(max_tokens=10_000), 400, "context_length_exceeded"),
    ("bad session id", "/v1/sessions", {"session_id": "../../etc"}, 400, None),
    (
        "deep task metadata",
        "/v1/sessions",
        json.loads(_nested(15).replace('"messages"', '"task"').replace('"model":"m",', "")),
        400,
        None,
    ),
    ("unknown session field", "/v1/sessions", {"owner": "someone-else"}, 400, None),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "code"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_table(make_gateway, name, path, body, status, code):
    gw = make_gateway(auth="off", **LIMITS)
    raw = (
        body
        if isinstance(body, bytes)
        else (body if isinstance(body, str) else json.dumps(body)).encode()
    )
    resp = gw.client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text[:300]
    if status >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error"
        if code:
            assert error["code"] == code, error


def test_chunked_body_over_the_limit_is_413_without_reading_it_all(make_gateway):
    gw = make_gateway(auth="off", **LIMITS)
    sent = []

    def chunks():
        for _ in range(100):  # 100 x 8 KiB = 800 KiB, no Content-Length
            sent.append(1)
            yield b"x" * 8192

    resp = gw.client.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_rate_limit_is_429_with_retry_after(make_gateway):
    gw = make_gateway(auth="on", rate_per_minute=6, rate_burst=2)
    a, b = gw.key("agent"), gw.key("agent")
    codes = [gw.client.post(CHAT, json=_chat(), headers=gw.auth(a)).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    limited = gw.client.post(CHAT, json=_chat(), headers=gw.auth(a))
    # 6 per minute = one token per 10 s; the bucket is empty, so the next token is <= 10 s away
    assert 1 <= int(limited.headers["retry-after"]) <= 10
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert gw.client.post(CHAT, json=_chat(), headers=gw.auth(b)).status_code == 200  # per key


class SlowEngine:
    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def generate(self, input_ids, sampling_params, affinity="", **_):
        await asyncio.sleep(self.delay_s)
        return Generation(
            output_ids=[2],
            output_logprobs=[-0.1],
            text="",
            finish_type="stop",
            matched_eos=True,
            weight_version=0,
            prompt_tokens=len(input_ids),
        )


async def _concurrent(app, n, headers):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await asyncio.gather(
            *[client.post(CHAT, json=_chat(), headers=headers) for _ in range(n)]
        )


def test_concurrency_limit_per_key(make_gateway):
    gw = make_gateway(auth="on", max_concurrent=2)
    gw.client.app.state.deps.engines = SlowEngine(0.3)
    key = gw.key("agent")
    replies = asyncio.run(_concurrent(gw.client.app, 4, gw.auth(key)))
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 200, 429, 429]
    assert all(r.headers["retry-after"] == "1" for r in replies if r.status_code == 429)
    # slots are released: the next request is served
    assert [r.status_code for r in asyncio.run(_concurrent(gw.client.app, 1, gw.auth(key)))] == [
        200
    ]


def test_request_timeout_is_504(make_gateway):
    gw = make_gateway(auth="off", request_timeout_s=0.2)
    gw.client.app.state.deps.engines = SlowEngine(5.0)
    resp = gw.client.post(CHAT, json=_chat())
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "timeout_error"
