"""EnginePool health: a failed engine is taken out (healthy engines serve first), probed, and
put back once `/health` answers 200. Engines are httpx MockTransport handlers."""

import asyncio

import httpx

from flywheel.gateway.engine_pool import ENGINE_UP, EnginePool

A, B = "http://engine-a", "http://engine-b"
GENERATE = {"text": "8", "output_ids": [28, 2], "meta_info": {
    "output_token_logprobs": [[-0.25, 28, None], [-0.5, 2, None]],
    "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3"}}


class Engines:
    def __init__(self):
        self.broken: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        self.calls.append((base, request.url.path))
        if base in self.broken:
            return httpx.Response(500, text="boom")
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json=GENERATE)


def _session_for(pool: EnginePool, first: str) -> str:
    return next(k for k in (f"s{i}" for i in range(100)) if pool.order(k)[0] == first)


def test_failed_engine_is_taken_out_and_put_back_when_healthy():
    async def run():
        engines = Engines()
        pool = EnginePool([A, B], 5.0, {2}, health_interval_s=0.05,
                          transport=httpx.MockTransport(engines))
        sid = _session_for(pool, A)
        engines.broken.add(A)
        gen = await pool.generate([1, 2, 3], {"max_new_tokens": 2}, affinity=sid)
        assert gen.output_ids == [28, 2] and gen.weight_version == 3
        assert engines.calls == [(A, "/generate"), (B, "/generate")]  # one retry elsewhere
        assert A in pool.down and ENGINE_UP.labels(A)._value.get() == 0
        engines.calls.clear()
        await pool.generate([1], {"max_new_tokens": 2}, affinity=sid)
        assert engines.calls[0] == (B, "/generate")  # out of service: not tried first
        await asyncio.sleep(0.2)
        assert (A, "/health") in engines.calls and A in pool.down  # probed, still failing
        engines.broken.clear()
        for _ in range(40):
            await asyncio.sleep(0.05)
            if A not in pool.down:
                break
        assert A not in pool.down and ENGINE_UP.labels(A)._value.get() == 1
        engines.calls.clear()
        await pool.generate([1], {"max_new_tokens": 2}, affinity=sid)
        assert engines.calls == [(A, "/generate")]  # the session is back on its engine
        await pool.aclose()

    asyncio.run(run())


def test_every_engine_out_is_still_tried():
    async def run():
        engines = Engines()
        pool = EnginePool([A, B], 5.0, {2}, health_interval_s=0,
                          transport=httpx.MockTransport(engines))
        pool.down = {A: 0.0, B: 0.0}
        gen = await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        assert gen.output_ids == [28, 2] and len(pool.down) == 1  # the one that served is back
        await pool.aclose()

    asyncio.run(run())
