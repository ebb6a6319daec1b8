"""Per-key rate and concurrency limits shared by every gateway replica (state in Redis).

Rate: a token bucket per identity in one Redis hash (`tokens`, `ts` in ms). A request takes one
token; the bucket refills at `rate_per_minute / 60` tokens per second up to `rate_burst`. The
clock is Redis's own (`TIME`), so replicas with skewed clocks still share one bucket.

Concurrency: a sorted set per identity whose members are leases (one per request in flight) and
whose scores are the lease expiry in ms. A request is admitted when fewer than `max_concurrent`
unexpired leases exist. The replica holding a lease renews it every `lease_s / 3` seconds while
the request runs and removes it when the request ends; a replica that crashes stops renewing, so
its slots come back `lease_s` seconds later at most (never leaked for good).

Both checks run in one Lua script (atomic, one round trip); a refused request takes neither a
token nor a slot. Keys: `<prefix>:limit:rate:<identity>`, `<prefix>:limit:inflight:<identity>`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import uuid
from dataclasses import dataclass

import redis

from flywheel.core.errors import BackpressureError
from flywheel.core.redis_client import LoopClients, ScriptCall
from flywheel.core.settings import SecuritySettings

log = logging.getLogger(__name__)

# KEYS: rate hash, in-flight zset. ARGV: tokens per ms, burst, max concurrent (0 = off),
# lease ms, lease member. Returns {1, 0, ""} (admitted) or {0, retry-after ms, reason}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local maxc, lease = tonumber(ARGV[3]), tonumber(ARGV[4])
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then return {0, 1000, 'concurrency'} end
end
if rate > 0 then
  local tokens = burst
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  if b[1] then
    tokens = math.min(burst, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate)
  end
  if tokens < 1 then return {0, math.ceil((1 - tokens) / rate), 'rate'} end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate) + 1000)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[2], now + lease, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], lease)
end
return {1, 0, ''}
"""

# KEYS: in-flight zsets; ARGV[1] lease ms, ARGV[i + 1] the member held in KEYS[i]. Extends the
# leases still present (an expired one is not brought back). Returns how many were extended.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, n = tonumber(ARGV[1]), 0
for i, key in ipairs(KEYS) do
  if redis.call('ZSCORE', key, ARGV[i + 1]) then
    redis.call('ZADD', key, now + lease, ARGV[i + 1])
    redis.call('PEXPIRE', key, lease)
    n = n + 1
  end
end
return n
"""


@dataclass(frozen=True)
class Lease:
    """One admitted request's concurrency slot (`member` of the sorted set `key`)."""

    key: str
    member: str


class RedisLimiter:
    """Rate (token bucket) and concurrency (leased slots) limits per identity, in Redis.

    Args:
        client: the gateway's Redis client (shared by every replica).
        prefix: key prefix (the stream prefix, as sessions and API keys use).
        settings: `rate_per_minute` (0 = no rate limit), `rate_burst`, `max_concurrent`
            (0 = no concurrency limit).
        lease_s: seconds a slot lives without renewal (default: the settings'
            `concurrency_lease_s`).
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        settings: SecuritySettings,
        lease_s: float | None = None,
    ):
        self.client = client
        self.prefix = prefix
        self.rate_per_ms = settings.rate_per_minute / 60_000.0
        self.burst = settings.rate_burst
        self.max_concurrent = settings.max_concurrent
        self.lease_s = lease_s if lease_s is not None else settings.concurrency_lease_s
        self.enabled = self.rate_per_ms > 0 or self.max_concurrent > 0
        self._admit = client.register_script(_ADMIT)
        self._loop_clients = LoopClients(client)
        self._replica = uuid.uuid4().hex[:12]
        self._serial = itertools.count(1)
        self._held: set[Lease] = set()
        """Leases of requests running on this replica (touched on the event loop only)."""
        self._renewer: asyncio.Task | None = None

    async def acquire(self, ident: str) -> Lease | None:
        """`admit` on the event loop (asyncio Redis client); the lease is renewed until
        `give_back`."""
        pending, call = self._admit_call(ident)
        lease = self._admitted(pending, await self._loop_clients.script(_ADMIT)(**call))
        if lease is not None:
            self._held.add(lease)
            loop = asyncio.get_running_loop()
            if (
                self._renewer is None
                or self._renewer.done()
                or self._renewer.get_loop() is not loop
            ):
                self._renewer = loop.create_task(self._renew_loop())
        return lease

    async def give_back(self, lease: Lease | None) -> None:
        """Stop renewing `lease` and `release` it off the event loop (also when cancelled)."""
        if lease is not None:
            self._held.discard(lease)
            await asyncio.shield(self._arelease(lease))

    def admit(self, ident: str) -> Lease | None:
        """Take one token and one concurrency slot for `ident` (blocking Redis call).

        Returns:
            The slot's lease (give it to `release`), or None when concurrency is unlimited.

        Raises:
            BackpressureError: out of tokens (Retry-After = seconds until the next token) or
                `max_concurrent` requests of this identity in flight on any replica (1 s).
            redis.RedisError: Redis is unreachable (the gateway answers 503).
        """
        lease, call = self._admit_call(ident)
        return self._admitted(lease, self._admit(**call))

    def _admit_call(self, ident: str) -> tuple[Lease, ScriptCall]:
        lease = Lease(
            f"{self.prefix}:limit:inflight:{ident}", f"{self._replica}:{next(self._serial)}"
        )
        return lease, {
            "keys": [f"{self.prefix}:limit:rate:{ident}", lease.key],
            "args": [
                repr(self.rate_per_ms),
                self.burst,
                self.max_concurrent,
                int(self.lease_s * 1000),
                lease.member,
            ],
        }

    def _admitted(self, lease: Lease, result: list) -> Lease | None:
        ok, retry_ms, reason = result
        if not ok:
            reason = reason.decode() if isinstance(reason, bytes) else reason
            if reason == "rate":
                wait = max(1, math.ceil(int(retry_ms) / 1000))
                raise rate_error(
                    f"rate limit of {self.rate_per_ms * 60_000:g} requests per "
                    f"minute reached for this key; retry in {wait} s",
                    wait,
                )
            raise rate_error(
                f"this key already has {self.max_concurrent} requests in flight; "
                "wait for one to finish",
                1,
            )
        return lease if self.max_concurrent else None

    def release(self, lease: Lease | None) -> None:
        """Give the slot back (blocking Redis call). On a Redis error the slot is logged and
        left to expire with its lease."""
        if lease is None:
            return
        try:
            self.client.zrem(lease.key, lease.member)
        except redis.RedisError as exc:
            log.warning(
                "could not release concurrency slot %s (%s); it expires in %g s",
                lease.key,
                exc,
                self.lease_s,
            )

    async def _arelease(self, lease: Lease) -> None:
        """`release` on the event loop."""
        try:
            await self._loop_clients.get().zrem(lease.key, lease.member)
        except redis.RedisError as exc:
            log.warning(
                "could not release concurrency slot %s (%s); it expires in %g s",
                lease.key,
                exc,
                self.lease_s,
            )

    async def _renew_loop(self) -> None:
        """Extend every held lease each third of `lease_s`; ends when none is held."""
        while self._held:
            await asyncio.sleep(self.lease_s / 3)
            held = list(self._held)
            if not held:
                break
            try:
                await self._loop_clients.script(_RENEW)(
                    keys=[lease.key for lease in held],
                    args=[int(self.lease_s * 1000), *[lease.member for lease in held]],
                )
            except redis.RedisError as exc:
                log.warning("could not renew %d concurrency leases: %s", len(held), exc)


def rate_error(message: str, retry_after_s: float) -> BackpressureError:
    """A 429 `rate_limit_exceeded` error with Retry-After `retry_after_s` seconds."""
    exc = BackpressureError(message, retry_after_s=retry_after_s)
    exc.code = "rate_limit_exceeded"
    return exc
