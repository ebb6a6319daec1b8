"""Session locks are leases: a holder that dies frees its session after the lease; a live holder
renews it, so a long turn is never entered twice."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from flywheel.core.errors import ConflictError
from flywheel.gateway.session import locks
from flywheel.gateway.session.store import SessionStore


def test_lock_of_a_dead_holder_expires_after_the_lease(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    store.acquire("s", lease_s=0.5)  # the holder "crashes": never released
    with pytest.raises(ConflictError):
        store.acquire("s", timeout_s=0.1)
    t0 = time.monotonic()
    store.release(store.acquire("s", timeout_s=5))
    assert time.monotonic() - t0 < 2.0


def test_a_running_turn_keeps_its_lock(redis_client, prefix, monkeypatch):
    monkeypatch.setattr(locks, "LOCK_LEASE_S", 0.6)
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    original = store.acquire

    async def long_turn() -> None:
        async with locks.locked(store, "s"):
            await asyncio.sleep(2.0)  # > 3 leases

    async def intruder() -> bool:
        await asyncio.sleep(1.0)
        try:
            await asyncio.to_thread(original, "s", timeout_s=0.3)
        except ConflictError:
            return False
        return True

    async def both():
        return await asyncio.gather(long_turn(), intruder())

    _, entered = asyncio.run(both())
    assert not entered


def test_a_turn_whose_lease_was_taken_over_is_not_saved(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    stale = store.acquire("s", lease_s=0.2)
    time.sleep(0.4)  # the lease expires: a second request takes the session and records a turn
    fresh = store.acquire("s", timeout_s=5)
    fresh.record.turns = 1
    with pytest.raises(ConflictError, match="taken over"):
        stale.record.turns = 7
        store.release(stale, stale.record)  # must not overwrite the holder's record
    store.release(fresh, fresh.record)
    assert store.get("s").turns == 1


def _queued(stream: str, sample_id: str):
    from flywheel.gateway.recording.records import Outgoing  # noqa: PLC0415

    return Outgoing(stream, f"payload-{sample_id}".encode(), sample_id, 0, 3, "")


def test_samples_are_added_only_with_the_save_of_their_record(redis_client, prefix):
    """A turn's Samples reach the stream in the same atomic step that saves its record: none
    when the turn fails (released unsaved) or its lease was taken over, each once otherwise."""
    stream = f"{prefix}:rollouts"
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    failed = store.acquire("s")
    failed.record.queue(_queued(stream, "a"))
    store.release(failed)  # the turn raised: released without saving
    assert redis_client.xlen(stream) == 0
    stale = store.acquire("s", lease_s=0.2)
    stale.record.queue(_queued(stream, "b"))
    time.sleep(0.4)
    fresh = store.acquire("s", timeout_s=5)
    with pytest.raises(ConflictError, match="taken over"):
        store.release(stale, stale.record)
    assert redis_client.xlen(stream) == 0  # the lost turn published nothing
    fresh.record.queue(_queued(stream, "c"))
    fresh.record.samples_published = 1
    store.release(fresh, fresh.record)
    entries = redis_client.xrange(stream)
    assert [e[1][b"sample"] for e in entries] == [b"payload-c"]
    assert store.get("s").samples_published == 1
    again = store.acquire("s")
    store.release(again, again.record)  # a later save publishes nothing again
    assert redis_client.xlen(stream) == 1


def test_async_release_publishes_with_the_save(redis_client, prefix):
    stream = f"{prefix}:rollouts"
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")

    async def turn() -> None:
        async with locks.locked(store, "s") as record:
            record.queue(_queued(stream, "x"))
            record.queue(_queued(stream, "y"))

    asyncio.run(turn())
    assert [e[1][b"sample"] for e in redis_client.xrange(stream)] == [b"payload-x", b"payload-y"]


def test_the_backlog_rule_in_each_stream_state(redis_client, prefix):
    """`StreamProducer.backlog` (the Lua rule the session save script also runs), sync and on
    the event loop, in each state: no stream, no group yet (whole stream), lag + pending, lag
    unknown after an XDEL (counted from the last delivered id)."""
    from flywheel.core.streams import StreamProducer  # noqa: PLC0415

    stream = f"{prefix}:rollouts"
    producer = StreamProducer(redis_client, stream, high_water=100, watch_group="reward")

    def both() -> tuple[int, int]:
        return producer.backlog(), asyncio.run(producer.abacklog())

    assert both() == (0, 0)  # no stream
    ids = [redis_client.xadd(stream, {"sample": b"x"}) for _ in range(4)]
    assert both() == (4, 4)  # no group yet: every entry
    redis_client.xgroup_create(stream, "reward", id="0")
    redis_client.xreadgroup("reward", "c", {stream: ">"}, count=1)
    assert both() == (4, 4)  # lag 3 + pending 1
    redis_client.xack(stream, "reward", ids[0])
    assert both() == (3, 3)  # lag 3 + pending 0
    redis_client.xdel(stream, ids[2])  # a deleted entry makes the group's lag unknown
    assert redis_client.xinfo_groups(stream)[0].get("lag") is None
    assert both() == (2, 2)  # entries after the last delivered id: ids[1], ids[3]


def test_a_turn_over_the_high_water_mark_is_refused_whole(redis_client, prefix):
    from flywheel.core.errors import BackpressureError  # noqa: PLC0415
    from flywheel.gateway.recording.records import Outgoing  # noqa: PLC0415

    stream = f"{prefix}:rollouts"
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    for _ in range(2):
        redis_client.xadd(stream, {"sample": b"old"})  # no reward group yet: backlog 2

    def turn(high_water: int) -> None:
        lease = store.acquire("s")
        lease.record.turns += 1
        lease.record.queue(Outgoing(stream, b"new", "id", 0, 3, "", high_water, "reward"))
        store.release(lease, lease.record)

    with pytest.raises(BackpressureError):
        turn(high_water=2)
    assert store.get("s").turns == 0 and redis_client.xlen(stream) == 2  # nothing written
    turn(high_water=3)  # below the mark: saved and published (the lock was released)
    assert store.get("s").turns == 1 and redis_client.xlen(stream) == 3


def test_requests_waiting_on_a_busy_session_leave_other_requests_served(
    procs, inproc_gateway, redis_client, prefix
):
    """While one turn holds a session (its engine hangs), 4x the worker-thread pool's size of
    reward posts wait for that session on the event loop. Requests that need the pool
    (`/readyz`, session create and read) are still answered at once; the waiters all go
    through once the turn ends (its engine call times out after 8 s), each reward recorded."""
    import concurrent.futures  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    gw = inproc_gateway([procs.stub("hang")], request_timeout_s=8.0)
    waiters = 4 * min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor size
    with httpx.Client(base_url=gw, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}).json()["session_id"]
        with concurrent.futures.ThreadPoolExecutor(waiters + 1) as pool:
            turn = pool.submit(
                client.post,
                f"/s/{sid}/v1/chat/completions",
                json={
                    "model": "m",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            time.sleep(1.0)  # the turn holds the session's lock
            posts = [
                pool.submit(
                    client.post,
                    f"/v1/sessions/{sid}/reward",
                    json={"name": f"r{i}", "reward": float(i)},
                )
                for i in range(waiters)
            ]
            time.sleep(1.0)  # every post waits for the lock
            assert not turn.done()
            with httpx.Client(base_url=gw, timeout=4.0) as quick:  # the turn has ~6 s left
                assert quick.get("/readyz").status_code == 200
                other = quick.post("/v1/sessions", json={}).json()["session_id"]
                assert quick.get(f"/v1/sessions/{other}").json()["status"] == "open"
            assert turn.result().status_code == 504  # the hanging engine timed out
            assert [p.result().status_code for p in posts] == [200] * waiters
    rewards = SessionStore(redis_client, prefix, 60).get(sid).rewards
    assert rewards == {f"r{i}": float(i) for i in range(waiters)}
