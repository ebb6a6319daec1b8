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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import redis
from prometheus_client import Counter
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from flywheel.core.errors import BackpressureError, ConflictError, NotFoundError
from flywheel.core.redis_client import LoopClients
from flywheel.core.streams import FIELD
from flywheel.core.streams import PUBLISHED as STREAM_PUBLISHED

log = logging.getLogger(__name__)


class Checkpoint(BaseModel):
    """The segment's extent right after one of its turns (a later request may continue there)."""

    messages: int
    tokens: int
    text: int = -1
    """Length of `Segment.text` (raw completions with a text prompt); -1 = not text."""
    ended_with_eos: bool = False


class Segment(BaseModel):
    """Token-faithful record of consecutive turns. Per-token lists all have the same length."""

    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    """Engine logprob of each sampled token; 0.0 where loss_mask is 0."""
    versions: list[int] = Field(default_factory=list)
    """Weight version of each sampled token; -1 where loss_mask is 0."""
    prompt_length: int = 0
    messages: list[dict[str, Any]] = Field(default_factory=list)
    """The conversation as recorded: request messages plus the assistant replies produced."""
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    finish_reason: str = ""
    ended_with_eos: bool = False
    sampling: dict[str, float] = Field(default_factory=dict)
    text: str = ""
    """Raw completions: the recorded prompt text + completion texts (the extension check)."""
    turn_start: int = 0
    """Offset of the last turn's first sampled token (live mode masks everything before it)."""
    checkpoints: list[Checkpoint] = Field(default_factory=list)
    """One per turn, in order: where the segment ended right after that turn."""

    def append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        """Append template ids (`sampled=False`) or engine-sampled ids with logprobs/versions."""
        n = len(ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * n)
        self.logprobs.extend(logprobs if sampled and logprobs is not None else [0.0] * n)
        self.versions.extend(versions if sampled and versions is not None else [-1] * n)
        if not (len(self.token_ids) == len(self.loss_mask) == len(self.logprobs)
                == len(self.versions)):
            raise AssertionError("segment per-token lists diverged in length")

    @model_validator(mode="after")
    def _legacy_checkpoint(self) -> Segment:
        """A segment stored before checkpoints existed ends right after its last turn."""
        if self.turns and not self.checkpoints and self.token_ids:
            self.mark_turn()
        return self

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def mark_turn(self) -> None:
        """Record a checkpoint at the current end (call right after a turn is appended)."""
        self.checkpoints.append(Checkpoint(messages=len(self.messages),
                                           tokens=len(self.token_ids),
                                           text=len(self.text) if self.text else -1,
                                           ended_with_eos=self.ended_with_eos))

    def upto(self, k: int) -> Segment:
        """A copy of this segment cut right after its turn `k` (0-based): the ids, masks,
        messages and text exactly as they were recorded then, the turn's later tokens dropped."""
        cp = self.checkpoints[k]
        out = self.model_copy(deep=True)
        for name in ("token_ids", "loss_mask", "logprobs", "versions"):
            setattr(out, name, getattr(out, name)[:cp.tokens])
        out.messages = out.messages[:cp.messages]
        out.text = out.text[:cp.text] if cp.text >= 0 else ""
        out.ended_with_eos = cp.ended_with_eos
        out.turns = k + 1
        out.checkpoints = out.checkpoints[:k + 1]
        out.turn_start = min(out.turn_start, cp.tokens)
        return out


class Candidate(BaseModel):
    """One choice of an n > 1 turn, not yet part of the segment (the client picks one)."""

    output_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    matched_eos: bool
    message: dict[str, Any]
    """The assistant message the client got for this choice."""


class Branch(BaseModel):
    """Live mode: a turn that waits for its next state while the session went on elsewhere
    (a parallel request on the same history, a regenerated or rewritten turn)."""

    segment: Segment
    """The segment as it was right after the turn (a later request may continue it)."""
    pending: str
    """The turn's Sample (base64 protobuf)."""


class SessionRecord(BaseModel):
    session_id: str
    group_id: str = ""
    task: dict[str, Any] = Field(default_factory=dict)
    """Task metadata for the reward service (e.g. `answer`, `verifier`)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["episode", "live"] = "episode"
    eval: bool = False
    """Evaluation sessions are served but never become training data."""
    status: Literal["open", "finished"] = "open"
    created_at: float = Field(default_factory=time.time)
    owner: str = ""
    segment: Segment = Field(default_factory=Segment)
    samples_published: int = 0
    forks: int = 0
    fork_reasons: dict[str, int] = Field(default_factory=dict)
    """Forks of this session per reason (recording.FORK_REASONS)."""
    turns: int = 0
    """Assistant turns recorded in the whole session (across segments): the next turn's index."""
    finish_request: str = ""
    """Digest of the finish request (reward, following messages): a repeat of the same finish
    (a client retrying after a lost response) is answered again instead of refused."""
    finish_published: int = 0
    """`samples_published` of the finish response (what a repeated finish answers)."""
    rewards: dict[str, float] = Field(default_factory=dict)
    """Rewards posted for the episode Sample (episode mode), published with it at finish."""
    pending: str = ""
    """Live mode: the last turn's Sample (base64 protobuf) waiting for its next state."""
    candidates: list[Candidate] = Field(default_factory=list)
    """n > 1 in a session: the choices of the last turn until the client sends one back."""
    branches: list[Branch] = Field(default_factory=list)
    """Live mode: other turns waiting for their next state, oldest first (see branches.py)."""
    finished_by: str = ""
    """Who finished the session: "client" (a finish request) or "idle" (the gateway's sweep)."""
    _outbox: list[Outgoing] = PrivateAttr(default_factory=list)
    """Samples to add to their stream when this record is saved (never stored itself)."""

    def queue(self, item: Outgoing) -> None:
        """Publish `item` with the next save of this record: `SessionStore.release` adds it to
        its stream in the same atomic step that saves the record, so a turn that fails or a
        gateway that dies before the save publishes nothing, and a saved turn everything, once.
        """
        self._outbox.append(item)


@dataclass(frozen=True)
class Outgoing:
    """A serialized Sample waiting for its record's save, and what the log says about it.

    `high_water` / `watch_group`: the stream's backpressure rule (`StreamProducer`), checked
    by the save itself."""

    stream: str
    payload: bytes
    sample_id: str
    turn_index: int
    tokens: int
    next_state_role: str
    high_water: int = 0
    watch_group: str = ""


PUBLISHED = Counter("flywheel_gateway_samples_published_total", "Samples published", ["mode"])
BACKPRESSURE = Counter("flywheel_gateway_samples_refused_backpressure_total",
                       "Samples of turns refused with 429 because the stream was at its "
                       "high-water mark (the client retries the turn; nothing was recorded)")


class _Owner(BaseModel):
    """The one field of a stored SessionRecord that access checks need."""

    owner: str = ""


LOCK_LEASE_S = 15.0
"""Seconds a session lock lives without renewal (holders renew it every third of that)."""

_TAKE = """
local record = redis.call('GET', KEYS[1])
if not record then return {0} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, record} end
return {2}
"""
"""Lock a session and read its record: {0} no session, {1, record} taken, {2} busy."""

_BACKLOG = """
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
"""The `StreamProducer.backlog` rule in Lua: the watched group's lag plus pending (lag counted
when Redis does not know it), the whole stream when the group does not exist yet."""

_PUT = _BACKLOG + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[4] == '1' then
  local high_water = tonumber(ARGV[9])
  if #ARGV > 10 and high_water > 0 and backlog(KEYS[4], ARGV[10]) >= high_water then
    redis.call('DEL', KEYS[2])
    return 2
  end
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  if ARGV[5] == 'open' then redis.call('ZADD', KEYS[3], ARGV[7], ARGV[6])
  else redis.call('ZREM', KEYS[3], ARGV[6]) end
  for i = 11, #ARGV do redis.call('XADD', KEYS[4], '*', ARGV[8], ARGV[i]) end
end
redis.call('DEL', KEYS[2])
return 1
"""
"""Save the record and its last-touch time in the idle index and add its queued Samples to
the stream KEYS[4] (when ARGV[4] is 1), then unlock; all only while the lock is still ours
(else 0). With Samples queued and the stream's backlog at its high-water mark ARGV[9] (watched
group ARGV[10]) nothing is written and the lock released (2): the turn is refused whole."""

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

LOST_LEASES = Counter("flywheel_gateway_session_lease_lost_total",
                      "Turns not saved because their session lock's lease expired meanwhile")


@dataclass
class SessionLease:
    """A held session lock: its random token, lease length and the record read under it."""

    session_id: str
    token: str
    lease_s: float
    record: SessionRecord


class SessionStore:
    """Sessions as JSON values under `<prefix>:session:<id>`, with a per-session lock.

    The lock is taken with the record read (`try_acquire`) and released with the record saved
    (`release`) in one round trip each; `atry_acquire` / `arenew` / `arelease` do the same on
    the event loop (an asyncio twin of `client`), the gateway's per-request path.

    Args:
        client: redis-py client.
        prefix: key prefix of the deployment.
        ttl_s: seconds an untouched session is kept.
    """

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int):
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.touched_key = f"{prefix}:sessions:touched"
        """Sorted set: open session id -> Unix time of its last save (the idle sweep's index)."""
        self._take = client.register_script(_TAKE)
        self._put = client.register_script(_PUT)
        self._renew = client.register_script(_RENEW)
        self._loop_clients = LoopClients(client)

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def _lock_key(self, session_id: str) -> str:
        return f"{self._key(session_id)}:lock"

    def create(self, **fields: Any) -> SessionRecord:
        """A new open session with a fresh id (or the given `session_id` if unused).

        Raises:
            ConflictError: `session_id` is given and already exists.
        """
        fields.setdefault("session_id", uuid.uuid4().hex)
        record = SessionRecord(**fields)
        ok = self.client.set(self._key(record.session_id), record.model_dump_json(),
                             ex=self.ttl_s, nx=True)
        if not ok:
            raise ConflictError(f"session {record.session_id} already exists", param="session_id")
        self.client.zadd(self.touched_key, {record.session_id: time.time()})
        return record

    def exists(self, session_id: str) -> bool:
        return bool(self.client.exists(self._key(session_id)))

    async def aowner(self, session_id: str) -> str:
        """The key id that owns the session ("" when created without authentication), read on
        the event loop without building the whole record.

        Raises:
            NotFoundError: no such session.
        """
        raw = await self._loop_clients.get().get(self._key(session_id))
        if raw is None:
            raise NotFoundError(f"session {session_id} not found", param="session_id")
        return _Owner.model_validate_json(raw).owner

    async def aexists(self, session_id: str) -> bool:
        """`exists` on the event loop."""
        return bool(await self._loop_clients.get().exists(self._key(session_id)))

    def get(self, session_id: str) -> SessionRecord:
        """Raises: NotFoundError: no such session (never created, or expired)."""
        raw = self.client.get(self._key(session_id))
        if raw is None:
            raise NotFoundError(f"session {session_id} not found", param="session_id")
        return SessionRecord.model_validate_json(raw)

    def idle(self, before: float, limit: int = 100, offset: int = 0) -> list[str]:
        """Ids of open sessions last saved before Unix time `before`, least recent first
        (`limit` of them, after skipping `offset`)."""
        return [raw.decode() if isinstance(raw, bytes) else raw for raw in
                self.client.zrangebyscore(self.touched_key, "-inf", before, start=offset,
                                          num=limit)]

    def index_existing(self) -> int:
        """Add sessions missing from the idle index (stored by a gateway version without it) as
        touched now, so the sweep finishes them too; returns how many were added."""
        head = f"{self.prefix}:session:"
        added = 0
        for raw in self.client.scan_iter(match=f"{head}*", count=500):
            key = raw.decode() if isinstance(raw, bytes) else raw
            if key.endswith(":lock") and self.client.exists(key.removesuffix(":lock")):
                continue  # a session's lock, not a session
            added += self.client.zadd(self.touched_key, {key[len(head):]: time.time()}, nx=True)
        return added

    def touched_at(self, session_id: str) -> float | None:
        """Unix time of the session's last save (None: not an open session)."""
        score = self.client.zscore(self.touched_key, session_id)
        return None if score is None else float(score)

    def forget(self, session_id: str) -> None:
        """Drop the session from the idle index (finished, or its record is gone)."""
        self.client.zrem(self.touched_key, session_id)

    def _take_call(self, session_id: str, lease_s: float) -> tuple[str, dict[str, list]]:
        token = uuid.uuid4().hex
        return token, {"keys": [self._key(session_id), self._lock_key(session_id)],
                       "args": [token, max(int(lease_s * 1000), 1)]}

    @staticmethod
    def _taken(session_id: str, token: str, lease_s: float, got: list) -> SessionLease | None:
        if got[0] == 0:
            raise NotFoundError(f"session {session_id} not found", param="session_id")
        if got[0] == 2:
            return None
        return SessionLease(session_id, token, lease_s, SessionRecord.model_validate_json(got[1]))

    def try_acquire(self, session_id: str, lease_s: float = LOCK_LEASE_S) -> SessionLease | None:
        """Take the session's lock and read its record in one round trip, or None when another
        holder has it.

        Raises:
            NotFoundError: no such session (never created, or expired).
        """
        token, call = self._take_call(session_id, lease_s)
        return self._taken(session_id, token, lease_s, self._take(**call))

    async def atry_acquire(self, session_id: str, lease_s: float = LOCK_LEASE_S
                           ) -> SessionLease | None:
        """`try_acquire` on the event loop."""
        token, call = self._take_call(session_id, lease_s)
        got = await self._loop_clients.script(_TAKE)(**call)
        return self._taken(session_id, token, lease_s, got)

    def acquire(self, session_id: str, timeout_s: float = 600.0,
                lease_s: float = LOCK_LEASE_S) -> SessionLease:
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

    def _renew_call(self, lease: SessionLease) -> dict[str, list]:
        return {"keys": [self._lock_key(lease.session_id)],
                "args": [lease.token, max(int(lease.lease_s * 1000), 1)]}

    def renew(self, lease: SessionLease) -> bool:
        """Extend the lease by its length; False when the lock is no longer held by it."""
        return bool(self._renew(**self._renew_call(lease)))

    async def arenew(self, lease: SessionLease) -> bool:
        """`renew` on the event loop."""
        return bool(await self._loop_clients.script(_RENEW)(**self._renew_call(lease)))

    def _put_call(self, lease: SessionLease, record: SessionRecord | None) -> dict[str, list]:
        outbox = record._outbox if record is not None else []
        rules = {(item.stream, item.high_water, item.watch_group) for item in outbox}
        if len(rules) > 1:
            raise ValueError(f"one save publishes to one stream, got {sorted(rules)}")
        stream, high_water, watch_group = rules.pop() if rules else (self.touched_key, 0, "")
        return {"keys": [self._key(lease.session_id), self._lock_key(lease.session_id),
                         self.touched_key, stream],
                "args": [lease.token, record.model_dump_json() if record else "", self.ttl_s,
                         1 if record is not None else 0, record.status if record else "",
                         lease.session_id, time.time(), FIELD,
                         high_water if watch_group else 0, watch_group,
                         *[item.payload for item in outbox]]}

    @staticmethod
    def _put_done(lease: SessionLease, record: SessionRecord | None, held: int) -> None:
        if record is None:
            return
        outbox, record._outbox = record._outbox, []
        if held == 2:
            BACKPRESSURE.inc(len(outbox))
            log.warning("session %s: the stream %s is at its high-water mark; the turn is "
                        "refused (429) and neither recorded nor published", lease.session_id,
                        outbox[0].stream)
            raise BackpressureError(
                f"stream {outbox[0].stream} has {outbox[0].high_water}+ unconsumed entries; "
                "the trainer is behind. Retry later.", retry_after_s=5.0)
        if not held:
            LOST_LEASES.inc()
            log.error("session %s: the lock's lease expired before the turn was saved; the "
                      "turn is not recorded and its %d Samples are not published",
                      lease.session_id, len(outbox))
            raise ConflictError(f"session {lease.session_id} was taken over while this request "
                                "ran (its lock lease expired); retry the request",
                                param="session_id")
        for item in outbox:
            STREAM_PUBLISHED.labels(item.stream).inc()
            PUBLISHED.labels(record.mode).inc()
            log.info("published sample %s of session %s turn %d (%d tokens, next_state %s)",
                     item.sample_id, lease.session_id, item.turn_index, item.tokens,
                     item.next_state_role or "-")

    def release(self, lease: SessionLease, record: SessionRecord | None = None) -> None:
        """Release the lock, first saving `record` when given (the record with a renewed TTL,
        and its last-save time in the idle index while it is open), in one round trip.

        Raises:
            ConflictError: `record` was given but the lease had expired and the lock is gone
                or held by someone else; nothing is written.
        """
        self._put_done(lease, record, self._put(**self._put_call(lease, record)))

    async def arelease(self, lease: SessionLease, record: SessionRecord | None = None) -> None:
        """`release` on the event loop."""
        held = await self._loop_clients.script(_PUT)(**self._put_call(lease, record))
        self._put_done(lease, record, held)

    @contextmanager
    def locked(self, session_id: str) -> Iterator[SessionRecord]:
        """Hold the session's lock while reading, changing and saving it.

        The record is saved on normal exit; on an exception nothing is written, so what was
        recorded before stays intact.
        """
        lease = self.acquire(session_id)
        try:
            yield lease.record
        except BaseException:
            self.release(lease)
            raise
        self.release(lease, lease.record)
