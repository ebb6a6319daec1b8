"""Stream statistics read from Redis: each pipeline stream's length and, per consumer group, its
lag and pending entries. Shared by `flywheel status` and the gateway's /metrics and dashboard;
`StreamStatsCollector` exports them as Prometheus gauges
(`flywheel_stream_{length,lag,pending}_entries`) from whichever process registers it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flywheel.core.retention import oldest_age_s, trimmed_counts
from flywheel.core.settings import StreamSettings

log = logging.getLogger(__name__)

STREAMS = ("rollouts", "scored", "train", "dead")
"""Stream names (StreamSettings fields) in pipeline order."""
LAG_SCAN_LIMIT = 10_000
"""Most entries counted by XRANGE when the server does not report lag (Redis < 7)."""


@dataclass
class GroupStat:
    """One consumer group of one stream."""

    group: str
    consumers: int
    pending: int
    """Entries delivered to a consumer and not acked yet."""
    lag: int | None
    """Entries not delivered to the group yet; None = unknown (Redis could not say)."""
    lag_capped: bool = False
    """True when lag was counted by scanning and reached LAG_SCAN_LIMIT (it is at least that)."""


@dataclass
class StreamStat:
    name: str
    key: str
    length: int
    groups: list[GroupStat] = field(default_factory=list)
    oldest_age_s: float | None = None
    """Seconds since the oldest entry kept was added; None = empty."""
    trimmed: int = 0
    """Entries trimmed by retention so far (core/retention.py)."""


def _lag_by_scan(client: redis.Redis, key: str, last_id: str) -> tuple[int, bool]:
    """Entries after `last_id` (exclusive), counted up to LAG_SCAN_LIMIT."""
    start = f"({last_id}" if last_id not in ("", "0-0") else "-"
    n = len(client.xrange(key, min=start, max="+", count=LAG_SCAN_LIMIT) or [])
    return n, n >= LAG_SCAN_LIMIT


def stream_stats(client: redis.Redis, streams: StreamSettings) -> list[StreamStat]:
    """Length of every pipeline stream, the age of its oldest entry, the entries retention
    has trimmed from it and, per consumer group, its lag and pending entries.

    Lag comes from XINFO GROUPS (`lag`, Redis >= 7); older servers, or a lag Redis reports as
    unknown (after XDEL/XTRIM), are counted by scanning the entries after the group's
    last-delivered id. A missing stream has length 0 and no groups.

    Raises:
        redis.RedisError: Redis is unreachable (callers show it as unhealthy).
    """
    out = []
    trimmed = trimmed_counts(client, streams.prefix)
    for name in STREAMS:
        key = streams.key(name)
        if not client.exists(key):
            out.append(StreamStat(name, key, 0, trimmed=trimmed.get(key, 0)))
            continue
        stat = StreamStat(
            name,
            key,
            int(client.xlen(key)),
            oldest_age_s=oldest_age_s(client, key),
            trimmed=trimmed.get(key, 0),
        )
        for info in client.xinfo_groups(key):
            group = _text(info["name"])
            lag = info.get("lag")
            capped = False
            if lag is None:
                lag, capped = _lag_by_scan(client, key, _text(info["last-delivered-id"]))
            stat.groups.append(
                GroupStat(group, int(info["consumers"]), int(info["pending"]), int(lag), capped)
            )
        out.append(stat)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StreamStatsCollector(Collector):
    """Prometheus gauges read from Redis at scrape time (one XLEN + XINFO GROUPS per stream).

    flywheel_stream_length_entries{stream}: entries in the stream (XLEN).
    flywheel_stream_lag_entries{stream,group}: entries not yet delivered to the group.
    flywheel_stream_pending_entries{stream,group}: delivered, not acked.
    A scrape while Redis is down yields the families without samples (and logs it).
    """

    def __init__(self, client: redis.Redis, streams: StreamSettings):
        self.client = client
        self.streams = streams

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "flywheel_stream_length_entries", "Entries in the stream (XLEN)", labels=["stream"]
            ),
            GaugeMetricFamily(
                "flywheel_stream_lag_entries",
                "Entries not yet delivered to the consumer group",
                labels=["stream", "group"],
            ),
            GaugeMetricFamily(
                "flywheel_stream_pending_entries",
                "Entries delivered to the group and not acked",
                labels=["stream", "group"],
            ),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        length, lag, pending = self._families()
        try:
            stats = stream_stats(self.client, self.streams)
        except redis.RedisError as exc:
            log.warning("stream gauges: Redis unavailable (%s)", exc)
            stats = []
        for s in stats:
            length.add_metric([s.name], s.length)
            for g in s.groups:
                if g.lag is not None:
                    lag.add_metric([s.name, g.group], g.lag)
                pending.add_metric([s.name, g.group], g.pending)
        yield from (length, lag, pending)
