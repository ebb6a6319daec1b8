"""Where the gateway's CPU per chat request goes: each stage of `bench/gateway.py`'s request
timed on its own, in one process, next to what the pass-through proxy does for the same request.

    .venv/bin/python bench/gateway_parts.py [--calls 2000]

Stages (microseconds per call, median of 5 batches of `--calls`), on the bench's request (one
user message, SmolLM2's template, the instant stub engine of bench/peers/stub_upstream.py and a
real Redis):
- body checks: the security middleware's `json.loads` + depth/encoding scan;
- validation: `ChatCompletionRequest.model_validate` of the parsed body;
- chat template: rendering the messages; tokenization: the rendered prompt's ids;
- engine call: `EnginePool.generate` (aiohttp POST of the ids, parse and check the reply)
  against a bare aiohttp POST of the request body, the proxy's whole upstream work;
- response: building the `chat.completion` body and its JSON;
- session lock + read and save + unlock: the recorded path's two Lua scripts (asyncio Redis),
  with the record of a one-turn session and of a 20,000-token one, each read from Redis
  (cache off) and held by the store since its last save (the record cache: only the lock and
  a 40-byte compare cross the wire); each turn of the long session adds 20 sampled tokens,
  and its save writes the record's head and those tokens (segment_log.py).
Async stages run on uvloop, as in the gateway. The server side (uvicorn, the ASGI middlewares)
is what `bench/gateway.py` measures around these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parents[1]
RECORDED = "session lock+read, save+unlock (one-turn record; record held (cache))"
"""The row of what recording adds to the bench's request (a session's next turn)."""
TURN_IDS, TURN_LOGPROBS, TURN_VERSIONS = list(range(20)), [-0.5] * 20, [1] * 20
"""What each timed turn of the long session adds to its record: 20 sampled tokens."""
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        samples.append((time.process_time() - t0) / calls * 1e6)
    return statistics.median(samples)


async def _per_call_us_async(fn: Callable[[], Awaitable[object]], calls: int) -> float:
    samples = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(calls):
            await fn()
        samples.append((time.process_time() - t0) / calls * 1e6)
    return statistics.median(samples)


async def measure(stub: str, redis_url: str, calls: int) -> list[tuple[str, float]]:
    from flywheel.core.paths import resolve_model_path  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.settings import GatewaySettings, SecuritySettings  # noqa: PLC0415
    from flywheel.gateway.access.security import _scan  # noqa: PLC0415
    from flywheel.gateway.api import chat  # noqa: PLC0415
    from flywheel.gateway.api.schemas import ChatCompletionRequest  # noqa: PLC0415
    from flywheel.gateway.engines.pool import EnginePool  # noqa: PLC0415
    from flywheel.gateway.render.tokenization import ChatRenderer  # noqa: PLC0415
    from flywheel.gateway.session import turns  # noqa: PLC0415
    from flywheel.gateway.session.store import SessionStore  # noqa: PLC0415

    raw = json.dumps(BODY).encode()
    depth = SecuritySettings().max_json_depth
    renderer = ChatRenderer(resolve_model_path(""))
    body = ChatCompletionRequest.model_validate(BODY)
    messages = [m.for_template() for m in body.messages]
    text = renderer.render(messages)
    ids = renderer.encode(text)
    sampling = body.sampling_params(GatewaySettings().default_max_tokens)
    pool = EnginePool([stub], 30.0, {2})
    gen = await pool.generate(ids, sampling)

    class Deps:
        settings = GatewaySettings()

    parsed = turns.parse_choice(Deps, body, gen)

    rows = [
        (
            "body checks (json.loads + scan)",
            _per_call_us(lambda: _scan(json.loads(raw), depth), calls),
        ),
        (
            "validation (pydantic model)",
            _per_call_us(lambda: ChatCompletionRequest.model_validate(json.loads(raw)), calls),
        ),
        ("chat template", _per_call_us(lambda: renderer.render(messages), calls)),
        ("tokenization", _per_call_us(lambda: renderer.encode(text), calls)),
        (
            "response body + JSON",
            _per_call_us(
                lambda: json.dumps(chat._response(Deps, body, [gen], len(ids), [parsed])), calls
            ),
        ),
    ]
    async with aiohttp.ClientSession() as http:

        async def bare() -> None:
            async with http.post(
                f"{stub}/v1/chat/completions",
                data=raw,
                headers={"content-type": "application/json"},
            ) as resp:
                await resp.read()

        rows.append(
            (
                "engine call (EnginePool.generate)",
                await _per_call_us_async(lambda: pool.generate(ids, sampling), calls),
            )
        )
        rows.append(("proxy: bare aiohttp POST", await _per_call_us_async(bare, calls)))
    await pool.aclose()
    client = connect(redis_url)
    stores = {
        "read from Redis": SessionStore(client, "parts", 600, cache_bytes=0),
        "record held (cache)": SessionStore(client, "parts", 600),
    }
    stores["read from Redis"].create(session_id="s")
    long = stores["read from Redis"].get("s")  # a long episode: 20,000 recorded tokens
    long.session_id = "long"
    long.segment.append(
        list(range(20_000)), sampled=True, logprobs=[-0.5] * 20_000, versions=[1] * 20_000
    )
    stores["read from Redis"].create(**long.model_dump())
    size = len(long.model_dump_json()) // 1024
    for sid, label, n in (
        ("s", "one-turn record", calls),
        ("long", f"20k-token record, {size} KiB", max(calls // 50, 5)),
    ):
        for how, store in stores.items():

            async def turn(store: SessionStore = store, sid: str = sid) -> None:
                lease = await store.atry_acquire(sid)
                if sid == "long":
                    lease.record.segment.append(
                        TURN_IDS, sampled=True, logprobs=TURN_LOGPROBS, versions=TURN_VERSIONS
                    )
                await store.arelease(lease, lease.record)

            await turn()  # the cache holds the record from here on
            rows.append(
                (
                    f"session lock+read, save+unlock ({label}; {how})",
                    await _per_call_us_async(turn, n),
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    from flywheel.core.redis_server import LocalRedis, free_port  # noqa: PLC0415

    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "bench/peers/stub_upstream.py", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-parts-") as tmp:
        redis = LocalRedis(Path(tmp)).start()
        try:
            time.sleep(1.0)
            rows = uvloop.run(measure(f"http://127.0.0.1:{port}", redis.url, args.calls))
        finally:
            stub.kill()
            redis.stop()
    width = max(len(name) for name, _ in rows) + 2
    print(f"{'stage':<{width}}{'us/call':>9}   (CPU time of this process; Redis's own excluded)")
    for name, us in rows:
        print(f"{name:<{width}}{us:>9.1f}")
    gateway_only = sum(us for name, us in rows if not name.startswith(("proxy", "session", " ")))
    print(
        f"\ngateway stages, unrecorded: {gateway_only:.0f} us; recorded adds "
        f"{dict(rows)[RECORDED]:.0f} us; the proxy's upstream call: "
        f"{dict(rows)['proxy: bare aiohttp POST']:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
