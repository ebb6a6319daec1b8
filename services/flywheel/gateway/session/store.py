"""Session and trajectory store in Redis, so gateway replicas are stateless.

A session is one episode (episode mode) or one live conversation. Its current `Segment` holds the
exact token history: prompt ids, then for each turn the sampled ids (loss mask 1, the engine's
logprobs and weight version) and the template ids between turns (mask 0). A request that no
longer extends the recorded history closes the segment (it becomes its own Sample) and starts a
new one.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import redis
from prometheus_client import Counter

from flywheel.core.errors import BackpressureError, ConflictError, NotFoundError
from flywheel.core.redis_client import LoopClients, ScriptCall, as_str
from flywheel.core.streams import FIELD
from flywheel.core.streams import PUBLISHED as STREAM_PUBLISHED
from flywheel.gateway.recording.record_cache import READS, Cached, RecordCache, rev_prefix
from flywheel.gateway.recording.records import SessionRecord
from flywheel.gateway.session.owner import Owner
from flywheel.gateway.session.script_deadline import LATE, ScriptDeadline
from flywheel.gateway.session.scripts import CREATE_LUA, PUT_LUA, READ_LUA, RENEW_LUA, TAKE_LUA
from flywheel.gateway.session.segment_log import StoredForm, parse_stored, stored_form

log = logging.getLogger(__name__)


PUBLISHED = Counter("flywheel_gateway_samples_published_total", "Samples published", ["mode"])
BACKPRESSURE = Counter(
    "flywheel_gateway_samples_refused_backpressure_total",
    "Samples of turns refused with 429 because the stream was at its "
    "high-water mark (the client retries the turn; nothing was recorded)",
)


def _ms(redis_time: tuple[int, int] | list[int]) -> float:
    """Milliseconds of Redis's `TIME` reply (seconds, microseconds)."""
    return int(redis_time[0]) * 1000 + int(redis_time[1]) / 1000


RECORD_CACHE_BYTES = 16 << 20
"""Bytes of stored JSON of the records a store keeps in memory by default (their Python objects:
at most about 110 MB)."""

LOCK_LEASE_S = 15.0
"""Seconds a session lock lives without renewal (holders renew it every third of that)."""

LOST_LEASES = Counter(
    "flywheel_gateway_session_lease_lost_total",
    "Turns not saved because their session lock's lease expired meanwhile",
)


class _Unreadable(Exception):
    """A record taken under the lock `token` that does not parse (the lock is to be released);
    `cause` is the parse error."""

    def __init__(self, token: str, cause: ValueError):
        super().__init__(token)
        self.token = token
        self.cause = cause


@dataclass
class SessionLease:
    """A held session lock: its random token, lease length and the record read under it."""

    session_id: str
    token: str
    lease_s: float
    record: SessionRecord


class SessionStore:
    """Sessions as JSON values under `<prefix>:session:<id>`, with a per-session lock
    (`<prefix>:session-lock:<id>`); the current segment's tokens and messages are a list of
    per-save chunks under `<prefix>:session-log:<id>` (segment_log.py), written and read with
    the record.

    The lock is taken with the record read (`try_acquire`) and released with the record saved
    (`release`) in one round trip each; `atry_acquire` / `arenew` / `arelease` do the same on
    the event loop (an asyncio twin of `client`), the gateway's per-request path.

    The asyncio path keeps the records it saved (record_cache.py): the next turn of the session
    on this gateway gets the held record when the stored one is still that version, so a turn
    reads no record from Redis.

    Args:
        client: redis-py client.
        prefix: key prefix of the deployment.
        ttl_s: seconds an untouched session is kept.
        cache_bytes: stored JSON bytes of the records kept in memory; 0 = none.
    """

    def __init__(
        self, client: redis.Redis, prefix: str, ttl_s: int, cache_bytes: int = RECORD_CACHE_BYTES
    ):
        self.client = client
        self.cache = RecordCache(cache_bytes)
        self.deadline = ScriptDeadline(
            client.connection_pool.connection_kwargs.get("socket_timeout")
        )
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.touched_key = f"{prefix}:sessions:touched"
        """Sorted set: open session id -> Unix time of its last save (the idle sweep's index)."""
        self._create = client.register_script(CREATE_LUA)
        self._read = client.register_script(READ_LUA)
        self._take = client.register_script(TAKE_LUA)
        self._put = client.register_script(PUT_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._loop_clients = LoopClients(client)

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def _lock_key(self, session_id: str) -> str:
        # Apart from `_key`'s names: a session id may contain ":" ("a:lock" is a valid id).
        return f"{self.prefix}:session-lock:{session_id}"

    def _log_key(self, session_id: str) -> str:
        return f"{self.prefix}:session-log:{session_id}"

    def _held_key(self, session_id: str) -> str:
        return f"{self.prefix}:session-held:{session_id}"

    def held_samples(self, session_id: str) -> list[bytes]:
        """The serialized Samples an episode holds until its finish, oldest first."""
        return cast("list[bytes]", self.client.lrange(self._held_key(session_id), 0, -1))

    def _new(self, fields: dict[str, Any]) -> tuple[SessionRecord, StoredForm, ScriptCall]:
        fields.setdefault("session_id", uuid.uuid4().hex)
        record = SessionRecord(**{**fields, "rev": uuid.uuid4().hex})
        form = stored_form(record)
        sid = record.session_id
        return (
            record,
            form,
            {
                "keys": [self._key(sid), self.touched_key, self._log_key(sid), self._held_key(sid)],
                "args": [form.head, self.ttl_s, sid, time.time(), form.chunk],
            },
        )

    def _created(self, record: SessionRecord, form: StoredForm, ok: int) -> SessionRecord:
        if not ok:
            raise ConflictError(f"session {record.session_id} already exists", param="session_id")
        record._log = form.logged
        if self.cache.max_bytes:  # a copy: the caller's record stays the caller's
            self.cache.put(record.session_id, record.model_copy(deep=True), form.size)
        return record

    def create(self, **fields: Any) -> SessionRecord:
        """A new open session with a fresh id (or the given `session_id` if unused), stored
        with its place in the idle index in one round trip.

        Raises:
            ConflictError: `session_id` is given and already exists.
        """
        record, form, call = self._new(fields)
        return self._created(record, form, self._create(**call))

    async def acreate(self, **fields: Any) -> SessionRecord:
        """`create` on the event loop."""
        record, form, call = self._new(fields)
        return self._created(record, form, await self._loop_clients.script(CREATE_LUA)(**call))

    def exists(self, session_id: str) -> bool:
        return bool(self.client.exists(self._key(session_id)))

    async def aowner(self, session_id: str) -> str:
        """The key id that owns the session ("" when created without authentication), read on
        the event loop without building the whole record, and without reading it when the
        record this gateway holds is still the stored one.

        Raises:
            NotFoundError: no such session.
        """
        client, key = self._loop_clients.get(), self._key(session_id)
        cached = self.cache.peek(session_id)
        if cached is not None:  # the stored record's first bytes say whether it is this one
            head = rev_prefix(cached.rev)
            if as_str(await client.getrange(key, 0, len(head) - 1)) == head:
                return cached.record.owner
        raw = await client.get(key)
        if raw is None:
            raise NotFoundError(f"session {session_id} not found", param="session_id")
        return Owner.model_validate_json(raw).owner

    async def aexists(self, session_id: str) -> bool:
        """`exists` on the event loop."""
        return bool(await self._loop_clients.get().exists(self._key(session_id)))

    def get(self, session_id: str) -> SessionRecord:
        """Raises: NotFoundError: no such session (never created, or expired)."""
        head, log = self._read(keys=[self._key(session_id), self._log_key(session_id)])
        if head is None:
            raise NotFoundError(f"session {session_id} not found", param="session_id")
        return parse_stored(head, log)

    def idle(self, before: float, limit: int = 100, offset: int = 0) -> list[str]:
        """Ids of open sessions last saved before Unix time `before`, least recent first
        (`limit` of them, after skipping `offset`)."""
        ids = self.client.zrangebyscore(self.touched_key, "-inf", before, start=offset, num=limit)
        return [as_str(raw) for raw in cast("list[bytes | str]", ids)]  # no WITHSCORES

    def index_existing(self) -> int:
        """Add sessions missing from the idle index (stored by a gateway version without it) as
        touched now, so the sweep finishes them too; returns how many were added."""
        head = f"{self.prefix}:session:"
        added = 0
        for raw in self.client.scan_iter(match=f"{head}*", count=500):
            key = raw.decode() if isinstance(raw, bytes) else raw
            if key.endswith(":lock") and self.client.exists(key.removesuffix(":lock")):
                continue  # a session's lock as an earlier version named it, not a session
            added += int(
                self.client.zadd(self.touched_key, {key[len(head) :]: time.time()}, nx=True) or 0
            )
        return added

    def touched_at(self, session_id: str) -> float | None:
        """Unix time of the session's last save (None: not an open session)."""
        score = self.client.zscore(self.touched_key, session_id)
        return None if score is None else float(score)

    def forget(self, session_id: str) -> None:
        """Drop the session from the idle index (finished, or its record is gone)."""
        self.client.zrem(self.touched_key, session_id)

    def _take_call(
        self, session_id: str, lease_s: float, cached: Cached | None = None
    ) -> tuple[str, ScriptCall]:
        token = uuid.uuid4().hex
        return token, {
            "keys": [self._key(session_id), self._lock_key(session_id), self._log_key(session_id)],
            "args": [
                token,
                max(int(lease_s * 1000), 1),
                rev_prefix(cached.rev) if cached is not None else "",
                self.deadline.deadline_ms(),
            ],
        }

    def _taken(self, session_id: str, token: str, lease_s: float, got: list) -> SessionLease | None:
        self.deadline.observe(got[1])
        if got[0] == 4:
            LATE.labels("lock").inc()
            log.warning(
                "session %s: the lock script reached Redis after the gateway stopped "
                "waiting for it; not applied",
                session_id,
            )
            raise redis.TimeoutError("Redis answered the session lock after its deadline")
        if got[0] == 0:
            raise NotFoundError(f"session {session_id} not found", param="session_id")
        if got[0] == 2:
            return None
        try:
            record = parse_stored(got[2], got[3])
        except ValueError as exc:  # CorruptRecord, or not a record's JSON: unlocked, refused
            log.error("session %s: its stored record cannot be read: %s", session_id, exc)
            raise _Unreadable(token, exc) from exc
        return SessionLease(session_id, token, lease_s, record)

    def try_acquire(self, session_id: str, lease_s: float = LOCK_LEASE_S) -> SessionLease | None:
        """Take the session's lock and read its record in one round trip, or None when another
        holder has it.

        Raises:
            NotFoundError: no such session (never created, or expired).
        """
        if not self.deadline.known and self.deadline.reply_timeout_s is not None:
            self.deadline.observe(_ms(self.client.time()))
        token, call = self._take_call(session_id, lease_s)
        try:
            return self._taken(session_id, token, lease_s, self._take(**call))
        except _Unreadable as exc:
            self._put(**self._unlock_call(session_id, exc.token))
            raise exc.cause from None

    async def atry_acquire(
        self, session_id: str, lease_s: float = LOCK_LEASE_S
    ) -> SessionLease | None:
        """`try_acquire` on the event loop."""
        if not self.deadline.known and self.deadline.reply_timeout_s is not None:
            self.deadline.observe(_ms(await self._loop_clients.get().time()))
        cached = self.cache.take(session_id)
        token, call = self._take_call(session_id, lease_s, cached)
        got = await self._loop_clients.script(TAKE_LUA)(**call)
        if got[0] == 3 and cached is not None:
            self.deadline.observe(got[1])
            READS.labels("cached").inc()
            return SessionLease(session_id, token, lease_s, cached.record)
        if got[0] in (2, 4) and cached is not None:
            self.cache.give_back(session_id, cached)
        elif got[0] == 1:
            READS.labels("stale" if cached is not None else "redis").inc()
        try:
            return self._taken(session_id, token, lease_s, got)
        except _Unreadable as exc:
            await self._loop_clients.script(PUT_LUA)(**self._unlock_call(session_id, exc.token))
            raise exc.cause from None

    def acquire(
        self, session_id: str, timeout_s: float = 600.0, lease_s: float = LOCK_LEASE_S
    ) -> SessionLease:
        """Take the session's lock, waiting up to `timeout_s` (usable from any thread); the
        lease carries the record as read under the lock. Release it with `release`.

        The lock expires `lease_s` seconds after it was taken or last renewed (`renew`), so a
        gateway that dies holding it blocks the session only that long.

        Raises:
            NotFoundError: no such session.
            ConflictError: the lock was not obtained within `timeout_s` seconds.
        """
        deadline, pause = time.monotonic() + timeout_s, 0.005
        while (lease := self.try_acquire(session_id, lease_s)) is None:
            if time.monotonic() >= deadline:
                raise ConflictError(f"session {session_id} is busy", param="session_id")
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.1)
        return lease

    def _renew_call(self, lease: SessionLease) -> ScriptCall:
        return {
            "keys": [self._lock_key(lease.session_id)],
            "args": [lease.token, max(int(lease.lease_s * 1000), 1)],
        }

    def renew(self, lease: SessionLease) -> bool:
        """Extend the lease by its length; False when the lock is no longer held by it."""
        return bool(self._renew(**self._renew_call(lease)))

    async def arenew(self, lease: SessionLease) -> bool:
        """`renew` on the event loop."""
        return bool(await self._loop_clients.script(RENEW_LUA)(**self._renew_call(lease)))

    def _put_call(
        self, lease: SessionLease, record: SessionRecord | None
    ) -> tuple[StoredForm | None, ScriptCall]:
        outbox = record._outbox if record is not None else []
        held = [item for item in outbox if item.hold]
        outbox = [item for item in outbox if not item.hold]
        rules = {(item.stream, item.high_water, item.watch_group) for item in outbox}
        if len(rules) > 1:
            raise ValueError(f"one save publishes to one stream, got {sorted(rules)}")
        stream, high_water, watch_group = rules.pop() if rules else (self.touched_key, 0, "")
        form = None
        if record is not None:
            record.rev = uuid.uuid4().hex
            form = stored_form(record)
        sid = lease.session_id
        return form, {
            "keys": [
                self._key(sid),
                self._lock_key(sid),
                self.touched_key,
                stream,
                self._log_key(sid),
                self._held_key(sid),
            ],
            "args": [
                lease.token,
                form.head if form else "",
                self.ttl_s,
                1 if record is not None else 0,
                record.status if record else "",
                sid,
                time.time(),
                FIELD,
                high_water if watch_group else 0,
                watch_group,
                self.deadline.deadline_ms(),
                1 if form and form.rewrite else 0,
                form.chunk if form else "",
                form.chunks_before if form else 0,
                len(held),
                1 if record is not None and record._release_held else 0,
                *[item.payload for item in held],
                *[item.payload for item in outbox],
            ],
        }

    def _unlock_call(self, session_id: str, token: str) -> ScriptCall:
        """The `PUT_LUA` call that only releases the lock `token` holds."""
        empty = SessionRecord(session_id=session_id)
        return self._put_call(SessionLease(session_id, token, 1.0, empty), None)[1]

    def _rewrite_call(
        self, lease: SessionLease, record: SessionRecord
    ) -> tuple[StoredForm | None, ScriptCall]:
        log.warning(
            "session %s: its stored record expired while a turn ran (or its log is not "
            "the one read); saving it whole",
            lease.session_id,
        )
        record._log = None
        return self._put_call(lease, record)

    @staticmethod
    def _put_done(
        lease: SessionLease, record: SessionRecord | None, form: StoredForm | None, held: int
    ) -> None:
        if held == 3:
            LATE.labels("save").inc()
            log.error(
                "session %s: the save reached Redis after the gateway stopped waiting for "
                "it; the lock is released, the turn is not recorded and its Samples are "
                "not published",
                lease.session_id,
            )
        if record is None:
            return
        outbox, record._outbox = record._outbox, []
        if held == 3:
            raise redis.TimeoutError(
                "Redis answered the session save after its deadline; the turn was not recorded"
            )
        if held == 2:
            BACKPRESSURE.inc(len(outbox))
            log.warning(
                "session %s: the stream %s is at its high-water mark; the turn is "
                "refused (429) and neither recorded nor published",
                lease.session_id,
                outbox[0].stream,
            )
            raise BackpressureError(
                f"stream {outbox[0].stream} has {outbox[0].high_water}+ unconsumed entries; "
                "the trainer is behind. Retry later.",
                retry_after_s=5.0,
            )
        if not held:
            LOST_LEASES.inc()
            log.error(
                "session %s: the lock's lease expired before the turn was saved; the "
                "turn is not recorded and its %d Samples are not published",
                lease.session_id,
                len(outbox),
            )
            raise ConflictError(
                f"session {lease.session_id} was taken over while this request "
                "ran (its lock lease expired); retry the request",
                param="session_id",
            )
        if form is not None:
            record._log = form.logged
        record._release_held = False
        for item in outbox:
            if item.hold:
                log.info(
                    "holding sample %s of session %s turn %d (%d tokens) until the episode "
                    "finishes",
                    item.sample_id,
                    lease.session_id,
                    item.turn_index,
                    item.tokens,
                )
                continue
            STREAM_PUBLISHED.labels(item.stream).inc()
            PUBLISHED.labels(record.mode).inc()
            log.info(
                "published sample %s of session %s turn %d (%d tokens, next_state %s)",
                item.sample_id,
                lease.session_id,
                item.turn_index,
                item.tokens,
                item.next_state_role or "-",
            )

    def release(self, lease: SessionLease, record: SessionRecord | None = None) -> None:
        """Release the lock, first saving `record` when given (the record with a renewed TTL,
        and its last-save time in the idle index while it is open), in one round trip.

        Raises:
            ConflictError: `record` was given but the lease had expired and the lock is gone
                or held by someone else; nothing is written.
        """
        form, call = self._put_call(lease, record)
        held = self._put(**call)
        if held == 4:  # the record expired while the turn ran: store it whole again
            assert record is not None  # the script answers 4 only to a save
            form, call = self._rewrite_call(lease, record)
            held = self._put(**call)
        self._put_done(lease, record, form, held)

    async def arelease(self, lease: SessionLease, record: SessionRecord | None = None) -> None:
        """`release` on the event loop."""
        form, call = self._put_call(lease, record)
        held = await self._loop_clients.script(PUT_LUA)(**call)
        if held == 4:  # the record expired while the turn ran: store it whole again
            assert record is not None  # the script answers 4 only to a save
            form, call = self._rewrite_call(lease, record)
            held = await self._loop_clients.script(PUT_LUA)(**call)
        self._put_done(lease, record, form, held)
        if record is not None and form is not None:  # saved: the next turn may use it as it is
            self.cache.put(lease.session_id, record, form.size)
