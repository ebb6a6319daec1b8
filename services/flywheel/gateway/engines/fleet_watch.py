"""A gateway's view of the shared engine fleet (core/fleet.py): every `fleet.refresh_s` it reads
the fleet from Redis (resolving DNS when discovery is on), lets the pool follow it, and puts a
joined engine in service once its `/model_info` weight version reaches the fleet's current
version, so no request is ever served by a joined engine's older weights. An engine in service
that later serves an older version than before (restarted on its initial weights) goes back to
pending the same way (`EnginePool.check_version`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
from prometheus_client import Gauge

from flywheel.core.fleet import Fleet
from flywheel.gateway.engines.pool import EnginePool

log = logging.getLogger(__name__)
FLEET_ENGINES = Gauge("flywheel_gateway_fleet_engines", "Engines of the fleet by state", ["state"])


class FleetWatch:
    """Keeps an `EnginePool` in step with a `Fleet`.

    Args:
        pool: the gateway's engine pool.
        fleet: the shared fleet.
        interval_s: seconds between refreshes (`fleet.refresh_s`).
    """

    def __init__(self, pool: EnginePool, fleet: Fleet, interval_s: float):
        self.pool = pool
        self.fleet = fleet
        self.interval_s = interval_s
        self._waiting_logged: dict[str, int | None] = {}

    async def refresh(self) -> None:
        """One pass: membership from Redis, then the version check of every pending engine.

        Raises:
            redis.RedisError: Redis did not answer (the pool keeps its engines).
        """
        urls = await asyncio.to_thread(self.fleet.refresh)
        version = await asyncio.to_thread(self.fleet.version)
        self.pool.set_members(urls)
        for url in list(self.pool.pending):
            served = await self.pool.served_version(url)
            if served is not None and served >= version:
                self.pool.admit(url, served)
                self._waiting_logged.pop(url, None)
            elif self._waiting_logged.get(url, -1) != served:
                self._waiting_logged[url] = served
                log.info(
                    "engine %s serves weight version %s, the fleet %d: not routed to yet",
                    url,
                    "unknown (no answer)" if served is None else served,
                    version,
                )
        for url in list(self.pool.urls):  # an engine restarted on older weights: pending
            self.pool.check_version(url, await self.pool.served_version(url))
        FLEET_ENGINES.labels("in_service").set(len(self.pool.urls))
        FLEET_ENGINES.labels("pending").set(len(self.pool.pending))

    async def run(self) -> None:
        """Refresh until cancelled; a failed refresh is logged and tried again."""
        while True:
            try:
                await self.refresh()
            except (redis.RedisError, OSError) as exc:
                log.warning("fleet refresh failed (%s); engines unchanged", exc)
            await asyncio.sleep(self.interval_s)

    async def describe(self) -> list[dict[str, Any]]:
        """Every fleet engine with its source, state (in_service, down, pending) and the
        weight version it serves (None when it does not answer)."""
        members = await asyncio.to_thread(self.fleet.members)
        out = []
        for url, source in members.items():
            state = (
                "pending"
                if url in self.pool.pending
                else "down"
                if url in self.pool.down
                else "in_service"
                if url in self.pool.urls
                else "unseen"
            )
            out.append(
                {
                    "url": url,
                    "source": source,
                    "state": state,
                    "weight_version": await self.pool.served_version(url),
                }
            )
        return out
