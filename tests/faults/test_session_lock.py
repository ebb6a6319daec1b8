"""Session locks are leases: a holder that dies frees its session after the lease; a live holder
renews it, so a long turn is never entered twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from flywheel.core.errors import ConflictError
from flywheel.gateway import turns
from flywheel.gateway.sessions import SessionStore


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
    monkeypatch.setattr(turns, "LOCK_LEASE_S", 0.6)
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    original = store.acquire

    async def long_turn() -> None:
        async with turns.locked(store, "s"):
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
