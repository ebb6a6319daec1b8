"""Retention of recorded data in the Redis streams: consumed entries older than
`streams.retention` are trimmed (docs/streams.md "Retention and trimming").

An entry may go only when every consumer group of its stream is done with it: delivered (at or
before the group's last-delivered id) and acked (older than the group's oldest pending id). So
the trim point of a stream is

    MINID = min( now - retention,
                 min over groups g of ( oldest pending id of g, if any,
                                        else the id right after g's last-delivered id ) )

and `XTRIM <stream> MINID <MINID>` (exact) deletes exactly the entries with smaller ids. A
stream without consumer groups is never trimmed (nobody has consumed it: the dead-letter
stream is kept until an operator deletes it). Computing the point and trimming are two steps;
between them groups only move forward (new deliveries and acks raise the point), so an entry
still pending in any group is never trimmed.

Worked example (ids written `ms-seq`): retention 3600 s, now = 10_000_000 ms, so the age cut is
10_000_000 - 3_600_000 = 6_400_000-0. Group `reward` has last-delivered 6_500_000-0 and nothing
pending: its point is 6_500_000-1. Group `audit` has 5_000_000-3 pending: its point is
5_000_000-3. MINID = min(6_400_000-0, 6_500_000-1, 5_000_000-3) = 5_000_000-3: the entries
before 5_000_000-3 go; 5_000_000-3 (pending) and everything after stay.

Counted in `flywheel_stream_trimmed_total{stream}` and, for `flywheel status`, in the Redis hash
`<prefix>:retention:trimmed` (stream -> entries trimmed so far); each trim is logged.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from prometheus_client import Counter

from flywheel.core.redis_client import as_str

log = logging.getLogger(__name__)
TRIMMED = Counter(
    "flywheel_stream_trimmed_total",
    "Stream entries trimmed by retention (consumed by every group and older than "
    "streams.retention)",
    ["stream"],
)
UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*")

StreamId = tuple[int, int]


def parse_duration(value: str | float | int) -> float:
    """Seconds in a duration: a number of seconds, or a string with a unit, e.g. "90s",
    "15m", "12h", "7d", "2w"; "0" = off.

    Raises:
        ValueError: a negative number, or a string that is neither (says the format).
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value)
        match = _DURATION.fullmatch(text)
        if match is not None:
            seconds = float(match.group(1)) * UNITS_S[match.group(2)]
        else:
            try:
                seconds = float(text)
            except ValueError:
                raise ValueError(
                    f"{value!r} is not a duration: write seconds (3600) or a number with a "
                    'unit s, m, h, d or w ("90s", "12h", "7d")'
                ) from None
    if seconds < 0:
        raise ValueError(f"a duration must not be negative, got {value!r}")
    return seconds


def parse_id(entry_id: str | bytes) -> StreamId:
    """A stream id "ms-seq" as (ms, seq)."""
    ms, _, seq = as_str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def trim_point(
    groups: Sequence[tuple[StreamId, StreamId | None]], now_ms: int, retention_ms: int
) -> StreamId | None:
    """The MINID below which every entry may be trimmed, or None (no groups: keep all).

    `groups`: per consumer group, (last-delivered id, oldest pending id or None).
    """
    if not groups:
        return None
    point: StreamId = (max(now_ms - retention_ms, 0), 0)
    for delivered, pending in groups:
        floor = pending if pending is not None else (delivered[0], delivered[1] + 1)
        point = min(point, floor)
    return point


def trim_stream(client: redis.Redis, stream: str, retention_s: float, prefix: str) -> int:
    """Trim `stream`'s entries consumed by every group and older than `retention_s` seconds;
    returns how many were deleted (0 when the stream or its groups do not exist).

    Raises:
        redis.RedisError: Redis unreachable (nothing half done: XTRIM is one command).
    """
    try:
        infos = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return 0
    groups: list[tuple[StreamId, StreamId | None]] = []
    for info in infos:
        name = as_str(info["name"])
        pending = None
        if int(info["pending"]):
            oldest = client.xpending(stream, name)["min"]
            pending = None if oldest is None else parse_id(oldest)
        groups.append((parse_id(info["last-delivered-id"]), pending))
    now_s, now_us = client.time()
    point = trim_point(groups, now_s * 1000 + now_us // 1000, int(retention_s * 1000))
    if point is None:
        return 0
    trimmed = int(client.xtrim(stream, minid=f"{point[0]}-{point[1]}", approximate=False))
    if trimmed:
        TRIMMED.labels(stream).inc(trimmed)
        client.hincrby(f"{prefix}:retention:trimmed", stream, trimmed)
        log.info(
            "trimmed %d entries of %s (consumed by every group and older than %.0f s)",
            trimmed,
            stream,
            retention_s,
        )
    return trimmed


def trim_streams(
    client: redis.Redis, streams: Sequence[str], retention_s: float, prefix: str
) -> int:
    """`trim_stream` on each of `streams`; returns the total trimmed. 0 `retention_s` = off."""
    if retention_s <= 0:
        return 0
    return sum(trim_stream(client, s, retention_s, prefix) for s in streams)


def oldest_age_s(client: redis.Redis, stream: str) -> float | None:
    """Seconds since the stream's oldest entry was added (by its id), or None when empty."""
    first = client.xrange(stream, count=1)
    if not first or first[0][0] is None:
        return None
    now_s, now_us = client.time()
    oldest_ms = parse_id(first[0][0])[0]
    return max(now_s + now_us / 1e6 - oldest_ms / 1000, 0.0)


def trimmed_counts(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Entries trimmed so far per stream key (all gateways together)."""
    raw = client.hgetall(f"{prefix}:retention:trimmed")
    return {as_str(k): int(v) for k, v in raw.items()}


@dataclass
class StreamRetention:
    """What a retention task trims: `streams` (full keys) of deployment `prefix`, entries
    consumed by every group and older than `retention_s` seconds, every `interval_s` seconds."""

    client: redis.Redis
    prefix: str
    streams: list[str]
    retention_s: float
    interval_s: float = 60.0

    def trim(self) -> int:
        """One pass over the streams; returns the entries trimmed (0 with retention off)."""
        return trim_streams(self.client, self.streams, self.retention_s, self.prefix)

    async def run(self) -> None:
        """Trim every `interval_s` until cancelled; a Redis error is logged and retried at the
        next pass (nothing is half done: each trim is one XTRIM)."""
        if self.retention_s <= 0:
            return
        while True:
            try:
                await asyncio.to_thread(self.trim)
            except redis.RedisError as exc:
                log.warning(
                    "stream retention pass failed (retried in %.0f s): %s", self.interval_s, exc
                )
            await asyncio.sleep(self.interval_s)
