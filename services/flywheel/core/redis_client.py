"""One way to build redis-py clients for services (bytes responses, bounded retries): a sync
client, and its asyncio twin for hot paths that must not hop to a thread per command."""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import hiredis
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript
from redis.retry import Retry


class ScriptCall(TypedDict):
    """The `keys` and `args` of one Lua script call (`script(**call)`)."""

    keys: list[str]
    args: list[Any]


def as_str(value: bytes | str) -> str:
    """A key, id or field as read from Redis (bytes from these clients), as text."""
    return value.decode() if isinstance(value, bytes) else value


def _retried(socket_timeout: float | None) -> tuple[type[redis.RedisError], ...]:
    """Errors a client retries: connection errors, and timeouts only while replies have no
    time limit (then a timeout can only be the connect's; a reply's may follow a command that
    ran)."""
    if socket_timeout is None:
        return (redis.ConnectionError, redis.TimeoutError)
    return (redis.ConnectionError,)


_COPIED = (
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "health_check_interval",
    "client_name",
    "credential_provider",
)
"""Connection settings an asyncio twin takes over from its sync client."""
_SSL = (
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_check_hostname",
    "ssl_password",
    "ssl_min_version",
    "ssl_ciphers",
)


ASYNC_POOL_SIZE = 128
"""Connections an asyncio twin opens at most; more concurrent commands wait for a free one."""
ASYNC_POOL_WAIT_S = 20.0
"""Seconds a command waits for a free connection before it fails (redis ConnectionError)."""


def connect(url: str, socket_timeout: float | None = None) -> redis.Redis:
    """A client for `url` that retries connection errors 3 times with jittered backoff.

    Args:
        socket_timeout: seconds to wait for one reply (None: no limit, for clients whose
            blocking stream reads wait longer). With a limit, a reply that does not come is a
            `redis.TimeoutError` that is not retried, since the command may have run.
    """
    return redis.Redis.from_url(
        url,
        retry=Retry(
            ExponentialWithJitterBackoff(base=0.05, cap=1.0),
            3,
            supported_errors=_retried(socket_timeout),
        ),
        retry_on_error=list(_retried(socket_timeout)),
        health_check_interval=30,
        socket_connect_timeout=5,
        socket_timeout=socket_timeout,
    )


def pack_command(*args: Any) -> list[bytes]:
    """One command in the Redis protocol, packed by hiredis in C (what redis-py's sync client
    does; its asyncio connections pack in Python, about 0.5 us per argument): the same bytes
    as redis-py's packer (RESP: `*<count>`, then `$<length>` and the bytes of each argument,
    floats as their repr; ("SET", "k", 0.1) -> SET, k, 0.1). A first argument with spaces
    ("CONFIG GET") is split into its words, as redis-py does.

    Raises:
        redis.DataError: an argument that is not str, bytes, int or float (None, bool, ...).
    """
    head = args[0]
    if isinstance(head, str):
        args = (*head.encode().split(), *args[1:])
    elif b" " in head:
        args = (*bytes(head).split(), *args[1:])
    packed: tuple[Any, ...] = tuple(
        bytes(a) if isinstance(a, bytearray | memoryview) else a for a in args
    )
    try:
        return [hiredis.pack_command(packed)]
    except TypeError as exc:
        raise redis.DataError(str(exc)) from None


class _HiredisPacking:
    """Mixin: an asyncio connection whose commands are packed by `pack_command`."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return pack_command(*args)


class _Connection(_HiredisPacking, aioredis.Connection):
    pass


class _UnixConnection(_HiredisPacking, aioredis.UnixDomainSocketConnection):
    pass


class _SSLConnection(_HiredisPacking, aioredis.SSLConnection):
    pass


def async_twin(client: redis.Redis) -> aioredis.Redis:
    """An asyncio client for the same server, database and credentials as `client` (TCP, TLS
    or a Unix socket), with the same bounded retries. Bound to the event loop that first uses
    it; build one per loop.

    Its pool holds up to `ASYNC_POOL_SIZE` connections and makes further commands wait for one
    (redis-py's default asyncio pool fails them at once with "Too many connections", which a
    burst of requests waiting on one busy session reached)."""
    kwargs = client.connection_pool.connection_kwargs
    settings = {k: kwargs[k] for k in _COPIED if k in kwargs}
    cls = client.connection_pool.connection_class
    if issubclass(cls, redis.UnixDomainSocketConnection):
        conn_cls: type[aioredis.connection.AbstractConnection] = _UnixConnection
        settings["path"] = kwargs["path"]
    else:
        settings.update(host=kwargs.get("host", "localhost"), port=kwargs.get("port", 6379))
        conn_cls = _Connection
        if issubclass(cls, redis.SSLConnection):
            conn_cls = _SSLConnection
            settings.update({k: kwargs[k] for k in _SSL if k in kwargs})
    pool = aioredis.BlockingConnectionPool(
        max_connections=ASYNC_POOL_SIZE,
        timeout=ASYNC_POOL_WAIT_S,
        connection_class=conn_cls,
        retry_on_error=list(retried := _retried(settings.get("socket_timeout"))),
        retry=AsyncRetry(
            ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3, supported_errors=retried
        ),
        **settings,
    )
    return aioredis.Redis(connection_pool=pool)


class LoopClients:
    """The asyncio twin of a sync client for the running event loop (a new loop, e.g. a test
    client's portal, gets its own; the previous loop's is dropped, not closed, since that loop
    may be gone), and Lua scripts registered on it."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._twin: aioredis.Redis | None = None
        self._scripts: dict[str, AsyncScript] = {}

    def get(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        if self._twin is None or self._loop is not loop:
            self._loop, self._twin, self._scripts = loop, async_twin(self.client), {}
        return self._twin

    def script(self, source: str) -> AsyncScript:
        """The Lua script `source` on this loop's client (EVALSHA, loaded on first use)."""
        client = self.get()
        found = self._scripts.get(source)
        if found is None:
            found = self._scripts[source] = client.register_script(source)
        return found
