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
event-loop iteration go out in one socket write and their replies are read in order by one
reader task, so concurrent requests share socket writes and reads and no request pays for
the connection pool, per-command timeouts and retries of redis-py's command path
(`bench/gateway.py`: the stored response is the difference between the Responses and chat
routes' CPU per request). The request still waits for
Redis's reply before its answer is sent, so a `previous_response_id` sent right after the answer,
to any replica, finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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


class _Link:
    """One connection of a SetPipe: the replies it still owes, oldest first, and its reader."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.reader: asyncio.Task[None] | None = None
        self.outbox: list[bytes] = []
        """Packed commands not yet written (flushed once per event-loop iteration)."""


class SetPipe:
    """SET commands of one event loop on one dedicated Redis connection, pipelined: `set`
    queues the command (written with the loop iteration's others) and waits for its reply,
    which one reader task reads in order. A failed connection fails every command waiting on
    it (redis.ConnectionError) and is replaced by a fresh one on the next `set`.

    Args:
        client: the loop's asyncio client (its pool makes the connection, which stays
            outside the pool, so the pool's connections serve everything else).
        timeout_s: seconds to wait for one reply before the connection is dropped (None:
            the client's socket timeout).
    """

    def __init__(self, client: aioredis.Redis, timeout_s: float | None = None):
        self.client = client
        self.timeout_s = timeout_s
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()

    async def _current(self) -> _Link:
        link = self._link
        if link is not None and link.conn.is_connected and not link.conn._writer.is_closing():
            return link
        async with self._connecting:
            if self._link is link:  # nobody replaced it meanwhile
                if link is not None:
                    self._drop(link, redis.ConnectionError("the Redis connection was closed"))
                conn = self.client.connection_pool.make_connection()
                await conn.connect()
                self._link = _Link(conn)
            assert self._link is not None
            return self._link

    async def set(self, key: str, value: bytes, ex: int) -> None:
        """SET `key` `value` EX `ex`, pipelined with the loop's other SETs.

        Raises:
            redis.RedisError: the write failed, Redis refused it or did not answer in time.
        """
        link = await self._current()
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        if not link.outbox:  # one write for every SET of this loop iteration
            loop.call_soon(self._flush, link)
        link.outbox.extend(link.conn.pack_command("SET", key, value, "EX", ex))
        link.waiting.append(reply)
        if link.reader is None or link.reader.done():
            link.reader = asyncio.ensure_future(self._read(link))
        result = await reply
        if isinstance(result, BaseException):
            raise result

    def _flush(self, link: _Link) -> None:
        """Write the commands queued on `link` (redis-py's StreamWriter: one syscall for all of
        them, in order; the reader reads their replies in the same order)."""
        out, link.outbox = link.outbox, []
        if out and link.conn._writer is not None and not link.conn._writer.is_closing():
            link.conn._writer.writelines(out)
        elif out:
            self._drop(link, redis.ConnectionError("the Redis connection was closed"))

    async def _read(self, link: _Link) -> None:
        """Read replies while commands wait; each settles its command's future (a Redis error
        reply is that command's exception)."""
        while link.waiting:
            try:
                got: Any = await link.conn.read_response(timeout=self.timeout_s)
            except redis.ResponseError as exc:
                got = exc
            except (TimeoutError, redis.RedisError, OSError) as exc:
                failure = exc if isinstance(exc, redis.RedisError) else None
                self._drop(link, failure or redis.ConnectionError(f"Redis read failed: {exc!r}"))
                return
            waiter = link.waiting.popleft()
            if not waiter.done():
                waiter.set_result(got)

    def _drop(self, link: _Link, exc: redis.RedisError) -> None:
        """Fail every command waiting on `link` and forget it (closed in the background)."""
        if self._link is link:
            self._link = None
        while link.waiting:
            waiter = link.waiting.popleft()
            if not waiter.done():
                waiter.set_result(exc)
        log.warning("stored-response Redis connection dropped: %s", exc)
        with contextlib.suppress(Exception):
            asyncio.ensure_future(link.conn.disconnect(nowait=True))


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
        head = dumps(
            {
                "owner": stored.owner,
                "session_id": stored.session_id,
                "conversation": stored.conversation,
            }
        )
        body = response_json if response_json is not None else dumps(stored.response)
        value = head[:-1] + b',"response":' + body + b"}"
        await self._pipe().set(self._key(response_id), value, self.ttl_s)

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
