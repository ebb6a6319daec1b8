"""The closed-loop request driver the gateway benchmarks share: `concurrency` workers POST one
body to a queue of paths back to back.

On aiohttp: its client costs a fraction of httpx's CPU per request, so at concurrency 64 on a
small machine the driver, not the target, would otherwise set the pace.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import aiohttp


class Driver:
    """A pooled keep-alive client for one base URL with up to `concurrency` connections.

    Use as `async with Driver(base, concurrency, headers) as d:`.
    """

    def __init__(
        self,
        base: str,
        concurrency: int,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60,
    ):
        # The driver's own full garbage collections (its process may hold torch and
        # transformers: hundreds of ms each) would show up as the target's latency tail.
        gc.freeze()
        self.base = base.rstrip("/")
        self.concurrency = concurrency
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, force_close=False),
            headers=headers or {},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )

    async def __aenter__(self) -> Driver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """(HTTP status, parsed JSON body or None)."""
        async with self._session.post(self.base + path, json=body) as resp:
            data = await resp.read()
            try:
                return resp.status, await resp.json(content_type=None) if data else None
            except ValueError:
                return resp.status, None

    async def drain(self, paths: list[str], body: dict[str, Any]) -> tuple[list[float], int]:
        """POST `body` to every path in `paths` (consumed) from `concurrency` workers.

        Returns:
            (latency in seconds of each 200 answer, number of errors: transport failures and
            non-200 answers).
        """
        latencies: list[float] = []
        errors = 0

        async def worker() -> None:
            nonlocal errors
            while paths:
                path = paths.pop()
                t0 = time.perf_counter()
                try:
                    async with self._session.post(self.base + path, json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (TimeoutError, aiohttp.ClientError):
                    errors += 1
                    continue
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        await asyncio.gather(*[worker() for _ in range(self.concurrency)])
        return latencies, errors
