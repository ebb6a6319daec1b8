"""The stored-response store (api/responses_store.py) on a real Redis: concurrent SETs on its
one pipelined connection all land with their expiry, owners are checked, and a connection Redis
closed fails only the writes waiting on it; the next write opens a new one."""

from __future__ import annotations

import asyncio

import pytest
import redis

from flywheel.core.errors import NotFoundError
from flywheel.core.redis_client import async_twin
from flywheel.gateway.api.responses_store import (
    ResponseStore,
    SetPipe,
    StoredResponse,
    pack_set,
    record_json,
)


def _stored(i: int) -> StoredResponse:
    return StoredResponse(
        "key-a",
        f"s{i}",
        [{"role": "user", "content": f"q{i}"}],
        {"id": f"resp_{i}", "object": "response", "n": 2**70},  # wider than 64 bits
    )


def test_concurrent_puts_land_in_order_with_their_expiry(redis_client, prefix):
    store = ResponseStore(redis_client, prefix, 120)

    async def run() -> list[StoredResponse]:
        await asyncio.gather(*(store.put(f"resp_{i}", _stored(i)) for i in range(50)))
        return [await store.get(f"resp_{i}", "key-a") for i in range(50)]

    got = asyncio.run(run())
    assert [g.session_id for g in got] == [f"s{i}" for i in range(50)]
    assert got[7].conversation == [{"role": "user", "content": "q7"}]
    assert got[7].response == {"id": "resp_7", "object": "response", "n": 2**70}
    assert 0 < redis_client.ttl(f"{prefix}:response:resp_7") <= 120
    with pytest.raises(NotFoundError):  # another key's id is answered like a missing one
        asyncio.run(store.get("resp_7", "key-b"))


def test_the_response_bytes_given_are_stored_as_they_are(redis_client, prefix):
    store = ResponseStore(redis_client, prefix, 120)
    body = b'{"id":"resp_x","object":"response","output":[]}'
    asyncio.run(store.put("resp_x", StoredResponse("", "", []), body))
    raw = redis_client.get(f"{prefix}:response:resp_x")
    assert raw.endswith(b',"response":' + body + b"}")
    asyncio.run(store.delete("resp_x", ""))
    assert redis_client.get(f"{prefix}:response:resp_x") is None


def test_the_record_embeds_the_response_bytes_in_one_json_value():
    body = b'{"id":"resp_1","output":[]}'
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "3"}]
    got = record_json(StoredResponse("k", "s1", conversation), body)
    assert got == (
        b'{"owner":"k","session_id":"s1","conversation":[{"role":"user","content":"Hi"},'
        b'{"role":"assistant","content":"3"}],"response":{"id":"resp_1","output":[]}}'
    )
    # A tool call's sampled arguments with an integer wider than 64 bits (orjson refuses it):
    # the same layout, the integer written exactly.
    wide = [{"role": "assistant", "content": None, "n": 2**70}]
    assert record_json(StoredResponse("k", "", wide), body) == (
        b'{"owner":"k","session_id":"","conversation":[{"role":"assistant","content":null,'
        b'"n":1180591620717411303424}],"response":{"id":"resp_1","output":[]}}'
    )


def test_a_connection_redis_closed_is_replaced(redis_client, prefix):
    store = ResponseStore(redis_client, prefix, 120)

    async def run() -> list[str]:
        await store.put("resp_a", _stored(1))
        redis_client.client_setname("test-killer")
        redis_client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        outcomes = []
        for i in range(3):  # the first may meet the closed socket; later ones reconnect
            try:
                await store.put(f"resp_b{i}", _stored(2))
                outcomes.append("ok")
            except redis.ConnectionError:
                outcomes.append("failed")
        return outcomes

    outcomes = asyncio.run(run())
    assert outcomes[1:] == ["ok", "ok"], outcomes
    assert asyncio.run(store.get("resp_b2", "key-a")).session_id == "s2"


def test_pack_set_writes_the_bytes_redis_py_would():
    from redis.asyncio.connection import Connection

    # header *5\r\n (4) + $3\r\nSET\r\n (9) + $1\r\nk\r\n (7) + $1\r\nv\r\n (7)
    # + $2\r\nEX\r\n (8) + $2\r\n60\r\n (8) = 43 bytes
    assert pack_set("k", b"v", 60) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nEX\r\n$2\r\n60\r\n"
    )
    assert len(pack_set("k", b"v", 60)) == 43
    value = b'{"conversation":"' + "é".encode() * 40_000 + b'"}'  # 80 KB, bytes as given
    for key, ex in (("fw:response:resp_1", 3600), ("fw:réponse:ü", 1)):
        expected = b"".join(Connection().pack_command("SET", key, value, "EX", ex))
        assert pack_set(key, value, ex) == expected


class _ThreeByteReads(asyncio.Protocol):
    """Hands a connection's bytes to its SetPipe protocol three bytes at a time."""

    def __init__(self, link: asyncio.Protocol):
        self.link = link

    def data_received(self, data: bytes) -> None:
        for i in range(0, len(data), 3):
            self.link.data_received(data[i : i + 3])

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.connection_lost(exc)


def test_replies_split_across_reads_settle_their_own_writes(redis_client, prefix):
    """Three-byte reads cut every `+OK\r\n` reply in two, and an error reply (EX 0 is refused)
    fails only its own write; the writes around it land."""
    store = ResponseStore(redis_client, prefix, 120)

    async def run() -> list[object]:
        pipe = store._pipe()
        await pipe.set(f"{prefix}:split:warm", b"w", 60)  # opens the connection
        link = pipe._link
        assert link is not None
        link.transport.set_protocol(_ThreeByteReads(link))
        writes = [
            pipe.set(f"{prefix}:split:{i}", b"v%d" % i, 0 if i == 5 else 60) for i in range(12)
        ]
        return await asyncio.gather(*writes, return_exceptions=True)

    outcomes = asyncio.run(run())
    assert [type(o).__name__ for o in outcomes] == ["NoneType"] * 5 + ["ResponseError"] + [
        "NoneType"
    ] * 6
    assert "expire" in str(outcomes[5])
    assert redis_client.get(f"{prefix}:split:4") == b"v4"
    assert redis_client.get(f"{prefix}:split:5") is None
    assert 0 < redis_client.ttl(f"{prefix}:split:11") <= 60


def test_writes_redis_does_not_answer_fail_with_a_timeout_and_the_next_reconnects(
    redis_client, prefix
):
    """While Redis holds write commands (CLIENT PAUSE WRITE), the pipe's one connection timer
    fails the waiting SET with redis.TimeoutError and drops the connection; after the pause
    the next SET lands on a fresh connection."""
    pipe = SetPipe(async_twin(redis_client), timeout_s=0.2)

    async def run() -> tuple[BaseException | None, object, object]:
        await pipe.set(f"{prefix}:before", b"1", 60)
        first = pipe._link
        redis_client.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        try:
            held: BaseException | None = None
            try:
                await pipe.set(f"{prefix}:held", b"2", 60)
            except redis.RedisError as exc:
                held = exc
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")
        await pipe.set(f"{prefix}:after", b"3", 60)
        return held, first, pipe._link

    held, first, second = asyncio.run(run())
    assert isinstance(held, redis.TimeoutError), held
    assert first is not second and second is not None
    assert redis_client.get(f"{prefix}:before") == b"1"
    assert redis_client.get(f"{prefix}:after") == b"3"
