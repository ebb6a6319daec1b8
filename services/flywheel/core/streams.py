"""Redis stream producer and consumer with at-least-once delivery (docs/streams.md).

Contract:
- Each entry holds one serialized `flywheel.v1.Sample` under the field `sample`.
- Producers never trim (no MAXLEN): unconsumed data is never evicted. Over the high-water mark
  they raise `BackpressureError` instead of writing.
- Consumers read in a consumer group, process, write the next stream, then `ack`. Entries left
  pending by a dead consumer are reclaimed with XAUTOCLAIM, following its cursor until it
  returns to 0-0. An entry delivered more than `max_deliveries` times, or one that does not
  decode, goes to the dead-letter stream with its error and is acked: never silently dropped.
- A consumer group found missing on a read (Redis came back without its data) is created again
  at the start of the stream, counted and logged; the consumer goes on reading.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import redis
from prometheus_client import Counter

from flywheel._proto import sample_pb2
from flywheel.core.codec import decode_sample, encode_sample
from flywheel.core.errors import BackpressureError, ContractError
from flywheel.core.redis_client import LoopClients

if TYPE_CHECKING:
    from flywheel.core.settings import StreamSettings

log = logging.getLogger(__name__)

ReadReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes] | None]]]]
"""XREAD/XREADGROUP reply of a RESP2 client with bytes responses: [(stream, [(id, fields)])];
fields is None for an entry deleted while pending."""

FIELD = b"sample"
"""Field of a stream entry that holds the serialized Sample."""

BACKLOG_LUA = """
local function backlog(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return 0 end
  for _, g in ipairs(groups) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then
      local lag = f['lag']
      if not lag then
        lag = #redis.call('XRANGE', stream, '(' .. f['last-delivered-id'], '+')
      end
      return tonumber(lag) + tonumber(f['pending'])
    end
  end
  return redis.call('XLEN', stream)
end
"""
"""The backlog rule as a Lua function `backlog(stream, group)`, for `StreamProducer.backlog`
and for scripts that publish atomically with other writes (the gateway's session save): the
group's lag plus its pending count, the lag counted from its last delivered id when Redis does
not know it (Redis < 7, or after an XDEL), the whole stream while the group does not exist, 0
without a stream."""
_BACKLOG_SCRIPT = BACKLOG_LUA + "return backlog(KEYS[1], ARGV[1])"

PUBLISHED = Counter("flywheel_stream_published_total", "Entries added to a stream", ["stream"])
ACKED = Counter("flywheel_stream_acked_total", "Entries acknowledged", ["stream", "group"])
DEAD = Counter("flywheel_stream_dead_lettered_total", "Entries moved to dead letter", ["stream"])
RECLAIMED = Counter("flywheel_stream_reclaimed_total", "Pending entries reclaimed", ["stream"])
GROUP_RECREATED = Counter(
    "flywheel_stream_group_recreated_total",
    "Consumer groups found missing on a read and created again (Redis restarted without its data)",
    ["stream", "group"],
)
LOST = Counter(
    "flywheel_stream_lost_total", "Pending entries found deleted on reclaim", ["stream", "group"]
)


def default_consumer_name() -> str:
    """`host-pid`: unique per process, stable for its lifetime."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class StreamEntry:
    """One delivered entry whose payload decoded to a valid Sample."""

    entry_id: str
    payload: bytes
    sample: sample_pb2.Sample


class StreamProducer:
    """Appends Samples to one stream, refusing to write past the high-water mark.

    Args:
        client: a redis-py client (bytes responses, i.e. `decode_responses=False`).
        stream: the full stream key, e.g. `flywheel:rollouts`.
        high_water: lag (entries not yet delivered to, or pending in, `watch_group`) above which
            `publish` raises `BackpressureError`; 0 = no limit.
        watch_group: the consumer group whose lag is checked.
    """

    def __init__(
        self, client: redis.Redis, stream: str, *, high_water: int = 0, watch_group: str = ""
    ):
        self.client = client
        self.stream = stream
        self.high_water = high_water
        self.watch_group = watch_group
        self._loop_clients = LoopClients(client)
        self._backlog = client.register_script(_BACKLOG_SCRIPT)

    def backlog(self) -> int:
        """Entries of `watch_group` not yet acked: its lag plus its pending count (the whole
        stream while the group does not exist; 0 without a watched group). One script call
        (`BACKLOG_LUA`)."""
        if not self.watch_group:
            return 0
        return int(self._backlog(keys=[self.stream], args=[self.watch_group]))

    async def abacklog(self) -> int:
        """`backlog` on the event loop (an asyncio twin of the client)."""
        if not self.watch_group:
            return 0
        script = self._loop_clients.script(_BACKLOG_SCRIPT)
        return int(await script(keys=[self.stream], args=[self.watch_group]))

    def publish(self, sample: sample_pb2.Sample) -> str:
        """Validate, serialize and XADD one Sample; returns the entry id.

        Raises:
            ContractError: the Sample violates an invariant.
            BackpressureError: the watched group's backlog is at the high-water mark.
        """
        payload = encode_sample(sample)
        if self.high_water and self.backlog() >= self.high_water:
            raise BackpressureError(
                f"stream {self.stream} has {self.high_water}+ unconsumed entries; the trainer "
                "is behind. Retry later.",
                retry_after_s=5.0,
            )
        entry_id = self.client.xadd(self.stream, {FIELD: payload})
        PUBLISHED.labels(self.stream).inc()
        return _s(entry_id)


class StreamConsumer:
    """Reads one stream in a consumer group with reclaim and dead-lettering.

    Args:
        client: a redis-py client (bytes responses).
        stream: the full stream key to read.
        group: consumer group name (created at id 0 with MKSTREAM if missing).
        consumer: this consumer's name, unique per process.
        dead_stream: full key of the dead-letter stream.
        max_deliveries: deliveries after which an entry is dead-lettered instead of returned.
        min_idle_ms: milliseconds an entry must be pending elsewhere before it is reclaimed.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        *,
        dead_stream: str,
        max_deliveries: int = 5,
        min_idle_ms: int = 60_000,
    ):
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_stream = dead_stream
        self.max_deliveries = max_deliveries
        self.min_idle_ms = min_idle_ms
        self.ensure_group()

    @classmethod
    def in_deployment(
        cls, client: redis.Redis, streams: StreamSettings, stream: str, group: str, consumer: str
    ) -> StreamConsumer:
        """A consumer of the deployment's stream `stream` ("rollouts", "scored", "train") in
        `group`, with its dead-letter stream and delivery policy (`streams.max_deliveries`,
        `streams.min_idle_ms`). `consumer`: this process's name; "" = `default_consumer_name()`.
        """
        return cls(
            client,
            streams.key(stream),
            group,
            consumer or default_consumer_name(),
            dead_stream=streams.key("dead"),
            max_deliveries=streams.max_deliveries,
            min_idle_ms=streams.min_idle_ms,
        )

    def ensure_group(self) -> None:
        """Create the group at the start of the stream if it does not exist yet."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int = 16, block_ms: int = 1000) -> list[StreamEntry]:
        """Reclaimed stale entries first, then new ones; at most `count` in all.

        Poison entries (undecodable, or delivered more than `max_deliveries` times) are moved to
        the dead-letter stream and acked here, so they are not returned. A missing group is
        created again (`ensure_group`) and this read returns nothing.
        """
        try:
            return self._read(count, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
        GROUP_RECREATED.labels(self.stream, self.group).inc()
        log.error(
            "consumer group %s of stream %s is gone (did Redis restart without its "
            "data?); creating it again at the start of the stream",
            self.group,
            self.stream,
        )
        self.ensure_group()
        return []

    def _read(self, count: int, block_ms: int) -> list[StreamEntry]:
        entries = self.reclaim(count)
        if len(entries) < count:
            reply = self.client.xreadgroup(
                self.group,
                self.consumer,
                {self.stream: ">"},
                count=count - len(entries),
                block=block_ms if not entries else None,
            )
            for _stream, items in cast(ReadReply, reply or []):
                entries.extend(self._to_entries(items))
        return entries

    def reclaim(self, count: int) -> list[StreamEntry]:
        """XAUTOCLAIM entries idle longer than `min_idle_ms`, paging by cursor until 0-0.

        Entries found deleted (trimmed while pending) are counted in `flywheel_stream_lost_total`
        and logged, then removed from the pending list by Redis itself.
        """
        claimed: list[tuple[bytes, dict | None]] = []
        cursor = "0-0"
        while len(claimed) < count:
            reply = self.client.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                min_idle_time=self.min_idle_ms,
                start_id=cursor,
                count=count - len(claimed),
            )
            cursor = _s(reply[0])
            claimed.extend(reply[1])
            lost = [_s(e) for e in (reply[2] if len(reply) > 2 else [])]  # Redis >= 7
            if any(fields is None for _, fields in reply[1]):
                lost += self._purge_deleted()  # Redis < 7: nil entries, left in the PEL
            if lost:
                LOST.labels(self.stream, self.group).inc(len(lost))
                log.error(
                    "entries deleted while pending, lost: %s",
                    lost,
                    extra={"stream": self.stream},
                )
            if cursor == "0-0":
                break
        live = [(eid, fields) for eid, fields in claimed if fields is not None]
        if not live:
            return []
        RECLAIMED.labels(self.stream).inc(len(live))
        return self.redelivered(live)

    def redelivered(self, items: list[tuple[bytes, dict]]) -> list[StreamEntry]:
        """Entries delivered again (reclaimed, or re-read from this consumer's own pending
        list after a restart) as `StreamEntry`s; those delivered more than `max_deliveries`
        times (a poison entry that stopped every consumer that took it) are dead-lettered and
        left out."""
        if not items:
            return []
        deliveries = self._delivery_counts([_s(eid) for eid, _ in items])
        fresh = []
        for eid, fields in items:
            n = deliveries.get(_s(eid), 1)
            if n > self.max_deliveries:
                payload = fields.get(FIELD, b"")
                self.dead_letter(_s(eid), payload, f"delivered {n} times without an ack")
            else:
                fresh.append((eid, fields))
        return self._to_entries(fresh)

    def _purge_deleted(self, page: int = 1000) -> list[str]:
        """Ids pending in the group whose entries no longer exist; acked, so each is counted
        lost once (Redis < 7 reports them to XAUTOCLAIM as nil without their id, every time)."""
        gone, start = [], "-"
        while True:
            rows = self.client.xpending_range(
                self.stream, self.group, min=start, max="+", count=page
            )
            ids = [_s(r["message_id"]) for r in rows]
            gone += [i for i in ids if not self.client.xrange(self.stream, min=i, max=i)]
            if len(rows) < page:
                break
            start = "(" + ids[-1]
        if gone:
            self.client.xack(self.stream, self.group, *gone)
        return gone

    def ack(self, entry_ids: list[str]) -> int:
        """XACK the given entries; returns how many were pending."""
        if not entry_ids:
            return 0
        n = int(self.client.xack(self.stream, self.group, *entry_ids))
        ACKED.labels(self.stream, self.group).inc(n)
        return n

    def dead_letter(self, entry_id: str, payload: bytes, error: str) -> None:
        """Move one entry to the dead-letter stream with its error, then ack it."""
        self.client.xadd(
            self.dead_stream,
            {
                FIELD: payload,
                b"error": error.encode(),
                b"source_stream": self.stream.encode(),
                b"source_id": entry_id.encode(),
                b"group": self.group.encode(),
            },
        )
        self.client.xack(self.stream, self.group, entry_id)
        DEAD.labels(self.stream).inc()
        log.error("dead-lettered %s from %s: %s", entry_id, self.stream, error)

    def _delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        rows = self.client.xpending_range(
            self.stream,
            self.group,
            min=min(entry_ids, key=_id_key),
            max=max(entry_ids, key=_id_key),
            count=len(entry_ids) * 4 + 16,
        )
        return {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}

    def _to_entries(self, items: Sequence[tuple[bytes, dict | None]]) -> list[StreamEntry]:
        out = []
        for raw_id, fields in items:
            entry_id = _s(raw_id)
            payload = (fields or {}).get(FIELD)
            if payload is None:
                names = sorted(_s(k) for k in fields or {})
                self.dead_letter(
                    entry_id, b"", f"entry has no {_s(FIELD)!r} field (fields: {names})"
                )
                continue
            try:
                sample = decode_sample(payload)
            except ContractError as exc:
                self.dead_letter(entry_id, payload, f"undecodable Sample: {exc}")
                continue
            out.append(StreamEntry(entry_id=entry_id, payload=payload, sample=sample))
        return out


def _s(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
