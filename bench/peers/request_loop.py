"""The closed-loop request driver the gateway benchmarks share: `concurrency` workers POST one
body to a queue of paths back to back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


async def drain(client: httpx.AsyncClient, paths: list[str], concurrency: int,
                body: dict[str, Any]) -> tuple[list[float], int]:
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
                resp = await client.post(path, json=body)
            except httpx.HTTPError:
                errors += 1
                continue
            if resp.status_code != 200:
                errors += 1
            else:
                latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return latencies, errors
