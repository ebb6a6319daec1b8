"""Client for SGLang-protocol engines: session-affine choice, one retry elsewhere on failure.

Affinity: rendezvous (highest random weight) hashing, Thaler & Ravishankar 1998: a session key
k scores every engine e with h(e, k) (64 bits of BLAKE2b) and goes to the highest score. Adding
an (N+1)-th engine moves a key only when the new engine outscores all N others, which happens
for 1/(N+1) of the keys; removing an engine moves only the keys it had (test_pool_affinity.py).

Fleet: the engines in service (`urls`) change with the shared fleet (core/fleet.py,
engines/fleet_watch.py). An engine that joins waits in `pending`, never routed to, until it
serves the fleet's weight version (`admit`).

Health: an engine whose call fails (connection error, 5xx, unusable answer) is taken out: it
goes to the end of every session's order, so healthy engines serve first. A background probe
(`GET /health` every `health_interval_s`) puts it back once it answers 200; while every engine
is out they are still tried, so one recovering engine serves at once. A call past `timeout_s`
is tried elsewhere too but leaves its engine in service (slow is not broken), and is a 504
when no engine served (timeouts.py).

Speaks only `/generate` with `input_ids` (the gateway never asks an engine to render text).
HTTP is aiohttp: per request it costs a fraction of httpx's CPU, and the engine call is the
largest part of the gateway's own work per request (`bench/gateway.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from prometheus_client import Counter, Gauge

from flywheel.core.errors import InvalidRequestError, UpstreamError
from flywheel.core.versions import parse_weight_version
from flywheel.gateway.engines.call_errors import (
    describe,
    is_refused,
    no_engine_served,
    unavailable_error,
)
from flywheel.gateway.engines.generation import Generation, parse_generation
from flywheel.gateway.engines.overload import BUSY_STATUSES, ENGINE_BUSY
from flywheel.gateway.engines.partial import generate_partial
from flywheel.gateway.engines.stream import generate_stream
from flywheel.gateway.engines.timeouts import is_timeout, note_timeout

log = logging.getLogger(__name__)
ENGINE_ERRORS = Counter("flywheel_gateway_engine_errors_total", "Failed engine calls", ["engine"])
ENGINE_UP = Gauge("flywheel_gateway_engine_up", "1 = engine in service, 0 = taken out", ["engine"])


_JSON = {"Content-Type": "application/json"}
IDLE_CLOSE_S = 4.0
"""Seconds an idle engine connection is kept for reuse: below uvicorn's 5 s keep-alive (SGLang
and most Python servers keep its default), so a POST never goes out on a connection the server
is closing at that moment (it would fail and take a healthy engine out of service)."""


def _score(url: str, key: str) -> int:
    """Rendezvous weight of engine `url` for session key `key`: 64 bits of BLAKE2b."""
    digest = hashlib.blake2b(f"{url}\n{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(urls: list[str], key: str) -> list[str]:
    """`urls` by descending rendezvous weight for `key` (the first is the key's engine)."""
    return sorted(urls, key=lambda url: _score(url, key), reverse=True)


def _generate_body(
    input_ids: list[int], sampling_params: dict[str, Any], top_logprobs_num: int
) -> dict[str, Any]:
    """A `/generate` body: ids in, logprobs of the sampled tokens (and `top_logprobs_num`
    alternatives per token when > 0) out."""
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    return body


class EnginePool:
    """Engines by URL; a session always goes to the same healthy engine.

    Args:
        urls: engine base URLs (SGLang servers, a router, or embedded engines); may start
            empty when the fleet (fleet_watch.py) fills it.
        timeout_s: seconds per call.
        stop_token_ids: ids whose sampling ends a turn (the tokenizer's EOS).
        health_interval_s: seconds between probes of engines taken out; 0 = never probe (an
            engine then comes back only by serving a request when all are out).
        stream_interval: sampled tokens per chunk of a streamed call.
    """

    def __init__(
        self,
        urls: list[str],
        timeout_s: float,
        stop_token_ids: set[int],
        health_interval_s: float = 2.0,
        stream_interval: int = 1,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self.stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self._client: aiohttp.ClientSession | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self.health_interval_s = health_interval_s
        self.stream_interval = stream_interval
        """Sampled tokens per chunk of a streamed call (SGLang's `stream_interval`)."""
        self.down: dict[str, float] = {}
        """Engines taken out -> monotonic time they failed."""
        self.pending: dict[str, float] = {}
        """Engines that joined the fleet and do not serve its weights yet -> monotonic time
        they joined (never routed to)."""
        self.seen: dict[str, int] = {}
        """Engine in service -> the newest weight version it was seen serving; an engine that
        later serves an older one was restarted on its initial weights (`demote`)."""
        self._prober: asyncio.Task[None] | None = None
        for url in self.urls:
            ENGINE_UP.labels(url).set(1)

    def _session(self) -> aiohttp.ClientSession:
        """The pooled keep-alive client, made on the running event loop (a new loop, e.g. a new
        test client portal, gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.closed or self._client_loop is not loop:
            self._client_loop = loop
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, ttl_dns_cache=300, keepalive_timeout=IDLE_CLOSE_S
                ),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                json_serialize=json.dumps,
            )
        return self._client

    async def _call(
        self,
        method: str,
        url: str,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """(status, body bytes) of one HTTP call.

        Raises:
            aiohttp.ClientError, TimeoutError: the call failed in transport.
        """
        extra: dict[str, Any] = (
            {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
        )
        if body is not None:  # orjson: a long prompt's ids encode ~10x faster than json's
            extra.update(data=orjson.dumps(body), headers=_JSON)
        async with self._session().request(method, url, **extra) as resp:
            return resp.status, await resp.read()

    def order(self, affinity: str) -> list[str]:
        """Engines in service in the order to try for this session key (rendezvous hashing,
        `rendezvous_order`): healthy ones first, then those taken out."""
        ring = rendezvous_order(self.urls, affinity)
        return [u for u in ring if u not in self.down] + [u for u in ring if u in self.down]

    def set_members(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Follow the fleet: engines no longer listed leave at once; new ones wait in
        `pending` until `admit`. Returns (joined, left).
        """
        wanted = [u.rstrip("/") for u in urls]
        left = [u for u in [*self.urls, *self.pending] if u not in wanted]
        for url in left:
            if url in self.urls:
                self.urls.remove(url)
            self.pending.pop(url, None)
            self.down.pop(url, None)
            self.seen.pop(url, None)
            ENGINE_UP.labels(url).set(0)
            log.info("engine %s left the fleet; its sessions move to the others", url)
        joined = [u for u in wanted if u not in self.urls and u not in self.pending]
        for url in joined:
            self.pending[url] = time.monotonic()
            ENGINE_UP.labels(url).set(0)
            log.info(
                "engine %s joined the fleet; not routed to until it serves the fleet's weights", url
            )
        return joined, left

    def admit(self, url: str, version: int) -> None:
        """Put pending engine `url` (serving weight `version`) in service."""
        if self.pending.pop(url, None) is not None:
            self.urls.append(url)
            self.seen[url] = version
            ENGINE_UP.labels(url).set(1)
            log.info("engine %s serves weight version %d: in service", url, version)

    def check_version(self, url: str, served: int | None) -> bool:
        """Record that engine `url` (in service) serves weight version `served` (None = no
        answer: nothing changes). An engine that serves an older version than it did before was
        restarted on its initial weights: it goes back to `pending` (routed no request) until it
        serves the fleet's version again. Returns True when it was taken out so."""
        if served is None or url not in self.urls:
            return False
        before = self.seen.get(url)
        if before is None or served >= before:
            self.seen[url] = served
            return False
        self.urls.remove(url)
        self.down.pop(url, None)
        self.seen.pop(url, None)
        self.pending[url] = time.monotonic()
        ENGINE_UP.labels(url).set(0)
        log.warning(
            "engine %s serves weight version %d after %d (restarted on its initial weights): "
            "not routed to until it serves the fleet's weights",
            url,
            served,
            before,
        )
        return True

    async def served_version(self, url: str) -> int | None:
        """The weight version `url` serves (`/model_info`, `/get_model_info` before SGLang
        0.5.12), or None when it does not answer."""
        for path in ("/model_info", "/get_model_info"):
            try:
                status, raw = await self._call("GET", f"{url}{path}", timeout_s=10.0)
                if status == 404:
                    continue
                if status != 200:
                    return None
                return parse_weight_version(orjson.loads(raw).get("weight_version"))
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                return None
        return None

    def mark_down(self, url: str, why: str) -> None:
        ENGINE_ERRORS.labels(url).inc()
        if url not in self.down:
            log.warning("engine %s taken out of service: %s", url, why)
            self.down[url] = time.monotonic()
            ENGINE_UP.labels(url).set(0)
        if self.health_interval_s > 0 and (self._prober is None or self._prober.done()):
            self._prober = asyncio.get_running_loop().create_task(self._probe_loop())

    def mark_up(self, url: str) -> None:
        if self.down.pop(url, None) is not None:
            log.info("engine %s back in service", url)
            ENGINE_UP.labels(url).set(1)

    async def probe(self) -> None:
        """One `GET /health` of every engine taken out; a 200 puts it back."""
        for url in list(self.down):
            try:
                status, _ = await self._call(
                    "GET", f"{url}/health", timeout_s=max(self.health_interval_s, 1.0)
                )
            except (aiohttp.ClientError, TimeoutError):
                continue
            # Back on older weights (restarted): pending, not in service (`check_version`).
            if status == 200 and not self.check_version(url, await self.served_version(url)):
                self.mark_up(url)

    async def _probe_loop(self) -> None:
        while self.down:
            await asyncio.sleep(self.health_interval_s)
            await self.probe()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        affinity: str = "",
        top_logprobs_num: int = 0,
    ) -> Generation:
        """`/generate` with input ids and logprobs; retried once on another engine on failure.

        `top_logprobs_num` > 0 also asks for that many alternatives per output token. A
        generation the engine aborted (finish_reason `abort`: a weight update or pause that
        aborts) continues from its tokens under the weights now served (partial.py), its
        tokens keeping the versions that sampled them.

        Raises:
            InvalidRequestError: the engine rejected the request (4xx).
            UpstreamError: every tried engine failed, or the engine aborted the generation
                more than `partial.MAX_ABORTS` times.
        """

        async def call(ids: list[int], params: dict[str, Any]) -> tuple[str, Generation]:
            return await self._generate(_generate_body(ids, params, top_logprobs_num), affinity)

        gen, _ = await generate_partial(call, input_ids, sampling_params)
        return gen

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        affinity: str = "",
        top_logprobs_num: int = 0,
        *,
        on_text: Callable[[str], None],
    ) -> Generation:
        """`generate`, streamed: `on_text` gets the cumulative text of each chunk as the
        engine samples it (stream.py). An aborted generation continues from its tokens, the
        client's text running on; broken after its first chunk, it is an UpstreamError (the
        text has been shown), never retried.

        Raises:
            InvalidRequestError, UpstreamError: as `generate`.
        """
        if self.stream_interval > 1:
            sampling_params = {**sampling_params, "stream_interval": self.stream_interval}
        body = _generate_body(input_ids, sampling_params, top_logprobs_num)
        return await generate_stream(self, body, affinity, on_text)

    async def _generate(self, body: dict[str, Any], affinity: str) -> tuple[str, Generation]:
        """One `/generate` answer and the engine that gave it (another engine once on failure).

        Raises:
            OverloadedError: an engine tried was full (429/503) and none served (overload.py).
            EngineTimeoutError: an engine tried did not answer within `timeout_s` and none
                served (timeouts.py).
            EngineUnavailableError: none is in service, or every engine tried refused the
                connection (not running, e.g. starting again): 503 with Retry-After.
            UpstreamError: every engine tried failed otherwise (call_errors.describe says how).
        """
        errors: list[str] = []
        busy: list[str] = []
        timeouts: list[str] = []
        refused: list[str] = []
        if not self.urls:
            raise unavailable_error(
                [
                    "none is in service: the fleet is empty or its engines do not serve the "
                    "current weights yet (GET /v1/admin/engines shows them)"
                ]
            )
        for url in self.order(affinity)[:2]:
            try:
                status, raw = await self._call("POST", f"{url}/generate", body)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if is_timeout(exc):  # slow, not broken: kept in service (timeouts.py)
                    ENGINE_ERRORS.labels(url).inc()
                    timeouts.append(note_timeout(url, self.timeout_s))
                    continue
                errors.append(f"{url}: {describe(exc)}")
                if is_refused(exc):
                    refused.append(errors[-1])
                self.mark_down(url, errors[-1])
                continue
            if status in BUSY_STATUSES:  # full or loading: busy, not broken (overload.py)
                ENGINE_BUSY.labels(url).inc()
                busy.append(f"{url}: HTTP {status} {raw[:200].decode(errors='replace')}")
                continue
            if 400 <= status < 500:
                raise InvalidRequestError(
                    f"engine rejected the request: {raw[:500].decode(errors='replace')}"
                )
            if status != 200:
                errors.append(f"{url}: HTTP {status} {raw[:200].decode(errors='replace')}")
                self.mark_down(url, errors[-1])
                continue
            try:
                gen = parse_generation(
                    orjson.loads(raw), self.stop_token_ids, body["sampling_params"]
                )
            except (ValueError, TypeError, AttributeError, UpstreamError) as exc:
                # a 200 that is not a /generate answer
                errors.append(f"{url}: unusable response ({exc})")
                self.mark_down(url, errors[-1])
                continue
            self.mark_up(url)
            return url, gen
        raise no_engine_served(busy, timeouts, refused, errors, self.timeout_s)

    async def aclose(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self._client is not None and not self._client.closed:
            await self._client.close()
