"""EnginePool health: a failed engine is taken out (healthy engines serve first), probed, and
put back once `/health` answers 200; an aborted generation continues from its tokens. Engines
are two small aiohttp servers on loopback that answer /generate and /health, or 500 while
broken."""

import asyncio
import json

import pytest
from aiohttp import web

from flywheel.core.errors import EngineUnavailableError, UpstreamError
from flywheel.gateway.engines.generation import ENGINE_ABORTS
from flywheel.gateway.engines.pool import ENGINE_UP, EnginePool

GENERATE = {
    "text": "8",
    "output_ids": [28, 2],
    "meta_info": {
        "output_token_logprobs": [[-0.25, 28, None], [-0.5, 2, None]],
        "finish_reason": {"type": "stop", "matched": 2},
        "weight_version": "3",
    },
}
ABORTED = {
    "text": "",
    "output_ids": [28],
    "meta_info": {
        "output_token_logprobs": [[-0.25, 28, None]],
        "weight_version": "3",
        "finish_reason": {"type": "abort", "message": "Abort all requests", "status_code": None},
    },
}


async def serve(handler) -> tuple[web.AppRunner, str]:
    """`handler` answering every path on a free local port: (its runner, its base URL)."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


class Engines:
    """Two engines on real sockets; `calls` lists (engine URL, path) in arrival order."""

    def __init__(self):
        self.broken: set[str] = set()
        self.aborts = 0
        """How many of the next /generate calls the engines abort."""
        self.calls: list[tuple[str, str]] = []
        self.bodies: list[dict] = []
        """JSON bodies of the /generate calls."""
        self.urls: list[str] = []
        self._runners: list[web.AppRunner] = []

    async def start(self) -> tuple[str, str]:
        for _ in range(2):
            runner, url = await serve(self._handler(len(self.urls)))
            self.urls.append(url)
            self._runners.append(runner)
        return self.urls[0], self.urls[1]

    def _handler(self, index: int):
        async def handle(request: web.Request) -> web.Response:
            base = self.urls[index]
            self.calls.append((base, request.path))
            if base in self.broken:
                return web.Response(status=500, text="boom")
            if request.path == "/health":
                return web.Response(status=200)
            self.bodies.append(await request.json())
            if self.aborts:
                self.aborts -= 1
                return web.json_response(ABORTED)
            return web.json_response(GENERATE)

        return handle

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


def _session_for(pool: EnginePool, first: str) -> str:
    return next(k for k in (f"s{i}" for i in range(100)) if pool.order(k)[0] == first)


def test_failed_engine_is_taken_out_and_put_back_when_healthy():
    async def run():
        engines = Engines()
        A, B = await engines.start()
        pool = EnginePool([A, B], 5.0, {2}, health_interval_s=0.05)
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
        await engines.stop()

    asyncio.run(run())


def test_every_engine_out_is_still_tried():
    async def run():
        engines = Engines()
        A, B = await engines.start()
        pool = EnginePool([A, B], 5.0, {2}, health_interval_s=0)
        pool.down = {A: 0.0, B: 0.0}
        gen = await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        assert gen.output_ids == [28, 2] and len(pool.down) == 1  # the one that served is back
        await pool.aclose()
        await engines.stop()

    asyncio.run(run())


@pytest.mark.parametrize("aborts", [1, 4])
def test_an_aborted_generation_continues_from_its_tokens(aborts):
    async def run():
        engines = Engines()
        A, B = await engines.start()
        pool = EnginePool([A, B], 5.0, {2}, health_interval_s=0)
        sid = _session_for(pool, A)
        before = ENGINE_ABORTS.labels(A)._value.get()
        engines.aborts = aborts
        try:
            if aborts == 1:
                gen = await pool.generate([1], {"max_new_tokens": 3}, affinity=sid)
                # part 1 [28] (aborted), part 2 [28, 2]: sent the prompt + [28], 3 - 1 tokens
                assert (gen.finish_type, gen.output_ids, gen.parts) == ("stop", [28, 28, 2], 2)
                assert engines.bodies[1]["input_ids"] == [1, 28]
                assert engines.bodies[1]["sampling_params"]["max_new_tokens"] == 2
            else:  # MAX_ABORTS (3) continuations, then the 4th abort is an error
                with pytest.raises(UpstreamError, match="aborted the generation 4 times"):
                    await pool.generate([1], {"max_new_tokens": 9}, affinity=sid)
            # Asked on the same engine, which stays in service: an abort is not a fault.
            assert engines.calls == [(A, "/generate")] * (aborts + 1 if aborts == 1 else 4)
            assert not pool.down
            assert ENGINE_ABORTS.labels(A)._value.get() == before + aborts
        finally:
            await pool.aclose()
            await engines.stop()

    asyncio.run(run())


def test_a_streamed_call_asks_for_the_interval_retries_before_its_first_chunk_and_continues():
    async def run():
        engines = Engines()
        a, b = await engines.start()
        pool = EnginePool([a, b], 5.0, {2}, health_interval_s=0, stream_interval=4)
        texts: list[str] = []
        try:
            engines.broken.add(a)  # fails before any chunk: the other engine serves it
            gen = await pool.generate_stream(
                [1, 2], {"max_new_tokens": 2}, _session_for(pool, a), on_text=texts.append
            )
            assert [url for url, path in engines.calls if path == "/generate"] == [a, b]
            # the engines here answer whole JSON, read as one chunk
            assert gen.output_ids == [28, 2] and texts == ["8"]
            assert engines.bodies[-1]["stream"] is True
            assert engines.bodies[-1]["sampling_params"]["stream_interval"] == 4
            engines.broken.clear()
            engines.aborts = 1  # an aborted stream continues from its token, its text runs on
            before = ENGINE_ABORTS.labels(b)._value.get()
            texts.clear()
            gen = await pool.generate_stream(
                [1, 2], {"max_new_tokens": 3}, _session_for(pool, b), on_text=texts.append
            )
            assert gen.output_ids == [28, 28, 2] and texts == ["", "8"]  # "" + "8"
            assert engines.bodies[-1]["input_ids"] == [1, 2, 28]
            assert ENGINE_ABORTS.labels(b)._value.get() == before + 1
        finally:
            await pool.aclose()
            await engines.stop()

    asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True])
def test_a_timed_out_call_is_a_504_naming_the_setting_and_keeps_the_engine(streamed):
    """Both engines answer after 1 s, the call's timeout is 0.2 s: each is tried once, neither
    is taken out (slow is not broken) and the error is a 504 naming gateway.request_timeout_s.
    A connection refused still takes its engine out."""
    from flywheel.core.errors import EngineTimeoutError
    from flywheel.gateway.engines.timeouts import ENGINE_TIMEOUTS

    async def run():
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(1.0)
            return web.json_response(GENERATE)

        runners, urls = [], []
        for _ in range(2):
            runner, url = await serve(slow)
            urls.append(url)
            runners.append(runner)
        pool = EnginePool(urls, 0.2, {2}, health_interval_s=0)
        before = ENGINE_TIMEOUTS.labels(urls[0])._value.get()
        with pytest.raises(EngineTimeoutError) as info:
            if streamed:
                await pool.generate_stream([1], {"max_new_tokens": 2}, "x", on_text=print)
            else:
                await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        assert info.value.http_status == 504 and "gateway.request_timeout_s" in str(info.value)
        assert pool.down == {}  # both still in service
        assert ENGINE_TIMEOUTS.labels(urls[0])._value.get() == before + 1
        for runner in runners:
            await runner.cleanup()
        # now nothing listens: connection refused, a 503 to retry (call_errors.py)
        with pytest.raises(EngineUnavailableError, match="connection refused"):
            await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        assert set(pool.down) == set(urls)
        await pool.aclose()

    asyncio.run(run())


def test_a_stream_past_the_timeout_after_its_first_chunk_is_a_504_naming_the_setting():
    """The engine sends one SSE chunk, then nothing for 1 s; the call's timeout is 0.3 s. The
    text had gone out, so no other engine is tried: the error is a 504 `engine_timeout` naming
    gateway.request_timeout_s, counted and logged as a timeout, and the engine stays in
    service (slow is not broken)."""
    from flywheel.core.errors import EngineTimeoutError
    from flywheel.gateway.engines.timeouts import ENGINE_TIMEOUTS

    async def run():
        calls: list[str] = []

        async def stalls(request: web.Request) -> web.StreamResponse:
            calls.append(request.path)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            first = {**GENERATE, "text": "8", "meta_info": {"weight_version": "3"}}
            await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
            await asyncio.sleep(1.0)
            return resp

        runner, url = await serve(stalls)
        pool = EnginePool([url], 0.3, {2}, health_interval_s=0)
        texts: list[str] = []
        before = ENGINE_TIMEOUTS.labels(url)._value.get()
        try:
            with pytest.raises(EngineTimeoutError) as info:
                await pool.generate_stream([1], {"max_new_tokens": 2}, "x", on_text=texts.append)
            assert texts == ["8"] and calls == ["/generate"]  # the text went out; not retried
            err = info.value
            assert (err.http_status, err.code) == (504, "engine_timeout")
            assert "gateway.request_timeout_s (0.3 s)" in str(err)
            assert "nothing was recorded" in str(err)
            assert ENGINE_TIMEOUTS.labels(url)._value.get() == before + 1
            assert pool.down == {}
        finally:
            await pool.aclose()
            await runner.cleanup()

    asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True])
def test_an_engine_still_loading_is_a_503_that_says_so(streamed):
    """The only engine answers 503 "the engine is loading" (as a restarted embedded engine does
    until its model is in): the client's 503 says busy or loading with the engine's reason, not
    that a queue is full, and the engine stays in service."""
    from flywheel.core.errors import OverloadedError

    async def run():
        async def loading(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "the engine is loading"}}, status=503)

        runner, url = await serve(loading)
        pool = EnginePool([url], 5.0, {2}, health_interval_s=0)
        with pytest.raises(OverloadedError) as info:
            if streamed:
                await pool.generate_stream([1], {"max_new_tokens": 2}, "x", on_text=print)
            else:
                await pool.generate([1], {"max_new_tokens": 2}, affinity="x")
        message = str(info.value)
        assert message.startswith("the engine is busy (its request queue is full, or it is")
        assert "the engine is loading" in message  # the engine's own reason
        assert info.value.http_status == 503 and info.value.retry_after_s == 1.0
        assert pool.down == {}
        await pool.aclose()
        await runner.cleanup()

    asyncio.run(run())
