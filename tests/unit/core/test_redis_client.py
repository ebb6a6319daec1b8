"""The asyncio twin of a sync Redis client reaches the same server, database and credentials
(TCP with a password, a Unix socket), and LoopClients gives each event loop its own client and
scripts. Real redis-server processes."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import redis

from flywheel.core.redis_client import LoopClients, async_twin, connect
from flywheel.core.redis_server import LocalRedis, find_redis_server


def test_twin_uses_the_password_and_database(tmp_path):
    with LocalRedis(tmp_path / "r", password="s3cret") as server:
        sync = connect(server.url.replace("/0", "/3"))  # database 3

        async def run() -> None:
            twin = async_twin(sync)
            await twin.set("k", "from-twin")
            await twin.aclose()

        asyncio.run(run())
        assert sync.get("k") == b"from-twin"
        assert connect(server.url).get("k") is None  # not in database 0
        wrong = redis.Redis(host="127.0.0.1", port=server.port, password="nope", db=3)

        async def refused() -> None:
            twin = async_twin(wrong)
            try:
                await twin.get("k")
            finally:
                await twin.aclose()

        with pytest.raises(redis.AuthenticationError):
            asyncio.run(refused())


def test_twin_of_a_unix_socket_client(tmp_path):
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--dir",
            str(tmp_path),
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        sync = redis.Redis(unix_socket_path=str(sock))
        for _ in range(100):
            try:
                sync.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)

        async def run() -> bytes:
            twin = async_twin(sync)
            await twin.set("u", "over-the-socket")
            value = await twin.get("u")
            await twin.aclose()
            return value

        assert asyncio.run(run()) == b"over-the-socket"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_each_event_loop_gets_its_own_client_and_scripts(redis_client, prefix):
    clients = LoopClients(redis_client)
    source = "return redis.call('INCR', KEYS[1])"

    async def run() -> tuple[object, object, int]:
        client = clients.get()
        script = clients.script(source)
        assert clients.get() is client and clients.script(source) is script  # same loop
        return client, script, await script(keys=[f"{prefix}:n"])

    first, second = asyncio.run(run()), asyncio.run(run())
    assert first[0] is not second[0] and first[1] is not second[1]  # a new loop, a new client
    assert (first[2], second[2]) == (1, 2)  # both reached the same server


def test_more_concurrent_commands_than_connections_wait_for_one(redis_client, prefix):
    """A burst larger than the pool (ASYNC_POOL_SIZE connections; redis-py's own asyncio pool
    stops at 100) is served in turn, not failed with "Too many connections"."""
    from flywheel.core.redis_client import ASYNC_POOL_SIZE  # noqa: PLC0415

    redis_client.set(f"{prefix}:k", b"v")
    n = 2 * ASYNC_POOL_SIZE + 44  # 300

    async def burst() -> list:
        twin = async_twin(redis_client)
        try:
            return await asyncio.gather(*[twin.get(f"{prefix}:k") for _ in range(n)])
        finally:
            await twin.aclose()

    assert asyncio.run(burst()) == [b"v"] * n


PACKED_ARGS = [
    ("SET", "k", "v"),
    ("SET", b"k", b"\x00\xff bytes"),
    ("EVALSHA", "a" * 40, 2, "key:1", "key:2", 7, -3, 0.1, 1e20, 2.5e-7, "é"),
    ("CONFIG GET", "maxmemory"),  # a command with a space is split into its words
    (b"CLIENT SETNAME", "n"),
    ("SET", "k", bytearray(b"ba"), memoryview(b"mv")),
    ("HSET", "h", "f", 2**62),
]


@pytest.mark.parametrize("args", PACKED_ARGS)
def test_the_twins_packer_writes_the_same_bytes_as_redis_pys(args):
    """The twin's connections pack with hiredis; redis-py's asyncio connection packs in Python.
    Worked example: ("SET", "k", "v") -> *3 $3 SET $1 k $1 v, each followed by CRLF."""
    from redis.asyncio.connection import Connection

    from flywheel.core.redis_client import pack_command

    python_packed = b"".join(bytes(c) for c in Connection().pack_command(*args))
    assert b"".join(pack_command(*args)) == python_packed
    if args == ("SET", "k", "v"):
        assert python_packed == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"


@pytest.mark.parametrize("bad", [None, True, ["x"], {"a": 1}])
def test_the_twins_packer_refuses_what_redis_py_refuses(bad):
    from flywheel.core.redis_client import pack_command

    with pytest.raises(redis.DataError):
        pack_command("SET", "k", bad)


def test_twin_commands_and_scripts_round_trip_through_the_hiredis_packer(redis_client, prefix):
    """Floats, bytes, text and a Lua script's keys and arguments reach the server as the sync
    client reads them back."""
    loops = LoopClients(redis_client)
    source = "return {KEYS[1], ARGV[1], ARGV[2], tostring(tonumber(ARGV[3]) * 2)}"

    async def run() -> list[bytes]:
        twin = loops.get()
        packer = twin.connection_pool.connection_class.pack_command
        assert packer is not redis.asyncio.Connection.pack_command  # the twin's own packer
        await twin.set(f"{prefix}:f", 0.1)
        await twin.hset(f"{prefix}:h", mapping={"é": b"\x00\xff", "n": 2**40})
        return await loops.script(source)(keys=[f"{prefix}:k"], args=["a b", b"\x01", 1.25])

    assert asyncio.run(run()) == [f"{prefix}:k".encode(), b"a b", b"\x01", b"2.5"]
    assert redis_client.get(f"{prefix}:f") == b"0.1"
    assert redis_client.hgetall(f"{prefix}:h") == {
        "é".encode(): b"\x00\xff",
        b"n": b"1099511627776",
    }
