"""Stored responses (Responses API `store`), kept in Redis: for `previous_response_id`,
`GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`.

One key per response, `<prefix>:response:<id>`, holding JSON `{"owner", "session_id",
"conversation", "response"}`: the key that created it (another key's id is answered like a
missing one, a 404), the session its turn was recorded in ("" when unrecorded), the conversation
as chat messages (the input of every response of the chain, then its reply exactly as recorded,
with tool call ids and argument strings as sampled; never the instructions) and the `response`
object as it was answered (the very bytes of the HTTP body, not encoded again). The key expires
`gateway.response_ttl_s` seconds after it was written.

Writes go through one pipelined connection per event loop (`SetPipe`): the SETs of one
event-loop iteration go out in one socket write, and the connection's protocol settles every
reply as its bytes arrive, in order, with no task, stream read or timer per response. The
commands are packed and the replies parsed (hiredis) right there, so no request pays for the
connection pool, per-command timeouts, retries, argument encoding or reply parsing of redis-py's
command path (`bench/gateway.py`: the stored response is the difference between the Responses
and chat routes' CPU per request). The request still waits for Redis's reply before its answer
is sent, so a `previous_response_id` sent right after the answer, to any replica, finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import hiredis
import orjson
import redis
import redis.asyncio as aioredis

from flywheel.core.errors import NotFoundError
from flywheel.core.redis_client import LoopClients
from flywheel.gateway.api.json_text import dumps

log = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    owner: str
    session_id: str
    conversation: list[dict[str, Any]]
    response: dict[str, Any] | None = field(default=None)
    """The `response` object as answered (None: stored before retrieval was served)."""


def pack_set(key: str, value: bytes, ex: int) -> bytes:
    r"""`SET key value EX ex` as one RESP command: an array of 5 bulk strings, the same bytes
    redis-py's `pack_command` writes, without its per-argument type dispatch.

    Example: pack_set("k", b"v", 60) is these 43 bytes:
    b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nEX\r\n$2\r\n60\r\n" (the header `*5\r\n`, 4;
    then per part `$<length>\r\n<part>\r\n`: SET 9, k 7, v 7, EX 8, 60 8; 4 + 39 = 43).
    """
    k, t = key.encode(), str(ex).encode()
    return b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (
        len(k),
        k,
        len(value),
        value,
        len(t),
        t,
    )


class _Link(asyncio.Protocol):
    """One connection of a SetPipe, as the protocol of its socket: the replies it still owes,
    oldest first, settled right where the socket's bytes arrive (`data_received`: no reader
    task, no stream read, no timeout scope per read), and the RESP parser of those bytes."""

    def __init__(self, pipe: SetPipe, conn: Any, transport: asyncio.Transport):
        self.pipe, self.conn, self.transport = pipe, conn, transport
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.outbox: list[bytes] = []
        """Packed commands not yet written (flushed once per event-loop iteration)."""
        self.replies = hiredis.Reader()
        """Replies read but not yet settled (a socket read may end inside one)."""
        self.settled = 0
        """Replies settled so far (the read timeout's sign of progress)."""
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False

    def data_received(self, data: bytes) -> None:
        """Settle every complete reply in `data`, oldest command first (a Redis error reply
        is that command's exception); a reply nobody waits for, or bytes that are not RESP,
        end the connection."""
        self.replies.feed(data)
        try:
            while (got := self.replies.gets()) is not False:
                if isinstance(got, hiredis.ReplyError):
                    got = redis.ResponseError(str(got))
                waiter = self.waiting.popleft()  # IndexError: a reply nobody asked for
                if not waiter.done():
                    waiter.set_result(got)
                self.settled += 1
        except (IndexError, hiredis.ProtocolError) as exc:
            self.pipe._drop(self, redis.ConnectionError(f"Redis read failed: {exc!r}"))

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe._drop(self, redis.ConnectionError(f"Redis closed the connection ({exc!r})"))


class SetPipe:
    """SET commands of one event loop on one dedicated Redis connection, pipelined: `set`
    queues the command (written with the loop iteration's others, in one socket write) and
    waits for its reply; the connection's protocol (`_Link`) settles the replies in order as
    their bytes arrive. A failed connection fails every command waiting on it
    (redis.ConnectionError, redis.TimeoutError) and is replaced by a fresh one on the next
    `set`.

    Only the connection's set-up (authentication, database, client name, TLS: redis-py's
    `connect`) goes through redis-py; then its socket's transport is handed to `_Link`, and
    commands and replies are written and parsed here (`pack_set`, hiredis). Per command that
    costs a fraction of redis-py's `pack_command`, `read_response` and stream reads, and no
    task or timer: one timer per connection watches for replies that stop coming.

    Args:
        client: the loop's asyncio client (its pool makes the connection, which stays
            outside the pool, so the pool's connections serve everything else).
        timeout_s: seconds without any reply while commands wait before the connection is
            dropped (checked every `timeout_s`, so a stalled connection fails its commands
            after between 1 and 2 times `timeout_s`; None: never).
    """

    def __init__(self, client: aioredis.Redis, timeout_s: float | None = None):
        self.client = client
        self.timeout_s = timeout_s
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self, link: _Link | None) -> _Link:
        async with self._connecting:
            if self._link is link:  # nobody replaced it meanwhile
                if link is not None:
                    self._drop(link, redis.ConnectionError("the Redis connection was closed"))
                conn = self.client.connection_pool.make_connection()
                await conn.connect()
                transport = conn._writer.transport
                self._link = _Link(self, conn, transport)
                transport.set_protocol(self._link)
            assert self._link is not None
            return self._link

    async def set(self, key: str, value: bytes, ex: int) -> None:
        """SET `key` `value` EX `ex`, pipelined with the loop's other SETs.

        Raises:
            redis.RedisError: the write failed, Redis refused it or did not answer in time.
        """
        link = self._link
        if link is None or link.closed:
            link = await self._connect(link)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        if not link.outbox:  # one write for every SET of this loop iteration
            loop.call_soon(self._flush, link)
        link.outbox.append(pack_set(key, value, ex))
        link.waiting.append(reply)
        if link.timer is None and self.timeout_s is not None:
            link.timer = loop.call_later(self.timeout_s, self._check, link, link.settled)
        result = await reply
        if isinstance(result, BaseException):
            raise result

    def _flush(self, link: _Link) -> None:
        """Write the commands queued on `link` (one syscall for all of them, in order; their
        replies come back in the same order)."""
        out, link.outbox = link.outbox, []
        if out and not link.closed and not link.transport.is_closing():
            link.transport.write(b"".join(out))
        elif out:
            self._drop(link, redis.ConnectionError("the Redis connection was closed"))

    def _check(self, link: _Link, settled: int) -> None:
        """The read timeout: drop `link` if commands wait and no reply came in the
        `timeout_s` since `settled` replies had been settled; else look again later."""
        link.timer = None
        if link.closed or not link.waiting:
            return
        if link.settled == settled:
            self._drop(link, redis.TimeoutError(f"no reply from Redis in {self.timeout_s} s"))
            return
        loop = asyncio.get_running_loop()
        link.timer = loop.call_later(self.timeout_s or 0.0, self._check, link, link.settled)

    def _drop(self, link: _Link, exc: redis.RedisError) -> None:
        """Fail every command waiting on `link` and forget it (closed in the background)."""
        if self._link is link:
            self._link = None
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        while link.waiting:
            waiter = link.waiting.popleft()
            if not waiter.done():
                waiter.set_result(exc)
        if link.closed:
            return
        link.closed = True
        log.warning("stored-response Redis connection dropped: %s", exc)
        link.transport.close()
        with contextlib.suppress(Exception):
            asyncio.ensure_future(link.conn.disconnect(nowait=True))


def record_json(stored: StoredResponse, response_json: bytes | None = None) -> bytes:
    """The stored value of `stored`: JSON `{"owner", "session_id", "conversation",
    "response"}`, the response as the bytes `response_json` when given (the HTTP body as
    answered, embedded without being parsed or encoded again), else `stored.response` encoded.

    Example: StoredResponse("k", "", [{"role": "user", "content": "Hi"}]) with response_json
    b'{"id":"resp_1"}' -> b'{"owner":"k","session_id":"","conversation":[{"role":"user",
    "content":"Hi"}],"response":{"id":"resp_1"}}' (one line).

    Raises:
        TypeError: the conversation or response holds something JSON cannot express.
    """
    body = response_json if response_json is not None else dumps(stored.response)
    record = {"owner": stored.owner, "session_id": stored.session_id}
    try:  # one encoding pass, the response's bytes copied in as they are
        return orjson.dumps(
            {**record, "conversation": stored.conversation, "response": orjson.Fragment(body)}
        )
    except TypeError:  # an integer wider than 64 bits: `dumps` writes it exactly
        head = dumps({**record, "conversation": stored.conversation})
        return head[:-1] + b',"response":' + body + b"}"


class ResponseStore:
    """Args: client: the gateway's Redis client; prefix: the deployment's key prefix; ttl_s:
    seconds a stored response is kept."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int):
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._clients = LoopClients(client)
        self._timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout")
        self._pipes: dict[int, SetPipe] = {}

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    def _pipe(self) -> SetPipe:
        client = self._clients.get()
        pipe = self._pipes.get(id(client))
        if pipe is None:  # a new event loop (or its new client): a new connection
            self._pipes = {id(client): (pipe := SetPipe(client, self._timeout_s))}
        return pipe

    async def put(
        self, response_id: str, stored: StoredResponse, response_json: bytes | None = None
    ) -> None:
        """Store a response (one pipelined SET with expiry). `response_json`: the response
        object's JSON bytes as answered (else `stored.response` is encoded here).

        Raises:
            redis.RedisError: Redis failed or did not answer within the client's timeout.
        """
        await self._pipe().set(
            self._key(response_id), record_json(stored, response_json), self.ttl_s
        )

    async def get(
        self, response_id: str, owner: str, param: str | None = "previous_response_id"
    ) -> StoredResponse:
        """The stored response `response_id` of `owner`.

        Raises:
            NotFoundError: none stored (never, expired, deleted, `store: false`) or another
                key's (naming `param`).
        """
        raw = await self._clients.get().get(self._key(response_id))
        data = orjson.loads(raw) if raw is not None else None
        if data is None or data.get("owner", "") != owner:
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise NotFoundError(f"{what} with id '{response_id}' not found.", param=param)
        return StoredResponse(
            data["owner"], data.get("session_id", ""), data["conversation"], data.get("response")
        )

    async def delete(self, response_id: str, owner: str) -> None:
        """Delete the stored response `response_id` of `owner`.

        Raises:
            NotFoundError: none stored, or another key's (param None, as OpenAI answers).
        """
        await self.get(response_id, owner, param=None)
        await self._clients.get().delete(self._key(response_id))
