"""The gateway's record cache: a session's next turn on the same gateway uses the record it saved
last only while Redis still holds that version; another replica's save, a direct write or a
failed turn make it read Redis again; the same traffic publishes the same Samples with the cache
on and off (real Redis and tokenizer, scripted engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from flywheel.core.errors import NotFoundError
from flywheel.gateway.recording.record_cache import READS, RecordCache
from flywheel.gateway.recording.records import SessionRecord
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session import locks
from flywheel.gateway.session.store import SessionStore

from .harness import gateway_app
from .test_live import ScriptEngine


def _reads() -> dict[str, float]:
    return {s: READS.labels(s)._value.get() for s in ("cached", "stale", "redis")}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _reads().items()}


def _record(sid: str, status: str = "open") -> SessionRecord:
    return SessionRecord(session_id=sid, rev=f"r{sid}", status=status)


def test_cache_keeps_the_least_recently_saved_within_its_byte_budget():
    cache = RecordCache(max_bytes=100)  # sizes: the stored JSON's bytes, given by the store
    cache.put("a", _record("a"), 40)
    cache.put("b", _record("b"), 40)
    cache.put("c", _record("c"), 40)  # 120 > 100: "a", saved first, goes
    assert cache.take("a") is None and len(cache) == 2 and cache.size == 80
    cache.put("b", _record("b"), 40)  # saved again: now the newest, "c" the oldest
    cache.put("d", _record("d"), 40)
    assert cache.take("c") is None and cache.take("b") is not None
    cache.put("big", _record("big"), 101)  # larger than the whole budget: not kept
    assert cache.take("big") is None and cache.size == 40  # "d" only
    cache.put("d", _record("d", status="finished"), 40)  # no more turns: dropped
    assert len(cache) == 0 and cache.size == 0
    off = RecordCache(max_bytes=0)
    off.put("a", _record("a"), 1)
    assert len(off) == 0


def test_an_entry_given_back_never_replaces_a_newer_save():
    cache = RecordCache(max_bytes=100)
    cache.put("s", _record("s"), 10)
    taken = cache.take("s")
    newer = _record("s")
    cache.put("s", newer, 20)  # another request on this gateway saved meanwhile
    cache.give_back("s", taken)
    assert cache.take("s").record is newer


def test_the_budget_counts_what_records_hold_besides_tokens(redis_client, prefix):
    """Sessions with big task metadata and no turns: the cache holds them only up to its
    budget in stored bytes (a count of recorded tokens would keep a million of them)."""
    store = SessionStore(redis_client, prefix, 60, cache_bytes=1 << 20)
    for i in range(20):  # 20 x 200 KB of task: 4 MB stored, at most 1 MB held
        store.create(session_id=f"s{i}", task={"doc": "x" * 200_000})
    assert store.cache.size <= 1 << 20 and len(store.cache) == 5  # 5 x ~200 KB


async def _turn(store: SessionStore, sid: str, reward: float, fail: bool = False) -> None:
    async with locks.locked(store, sid) as record:
        record.rewards[f"r{reward}"] = reward
        record.segment.append([int(reward)], sampled=True, logprobs=[-0.5], versions=[1])
        if fail:
            raise RuntimeError("the engine call failed")


def test_turns_use_the_saved_record_until_someone_else_saves(redis_client, prefix):
    a, b = SessionStore(redis_client, prefix, 60), SessionStore(redis_client, prefix, 60)
    a.create(session_id="s")  # a holds the record it created
    before = _reads()
    asyncio.run(_turn(a, "s", 1))
    asyncio.run(_turn(a, "s", 2))
    asyncio.run(_turn(a, "s", 3))
    assert _delta(before) == {"cached": 3, "stale": 0, "redis": 0}
    asyncio.run(_turn(b, "s", 4))  # replica b: its first read is from Redis
    asyncio.run(_turn(a, "s", 5))  # a's cached record misses b's turn: read again
    assert _delta(before) == {"cached": 3, "stale": 1, "redis": 1}
    stored = a.get("s")
    assert stored.segment.token_ids == [1, 2, 3, 4, 5]
    assert stored.rewards == {"r1": 1, "r2": 2, "r3": 3, "r4": 4, "r5": 5}


def test_a_failed_turn_leaves_nothing_of_its_changes_in_memory(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    with pytest.raises(RuntimeError):
        asyncio.run(_turn(store, "s", 2, fail=True))  # changed the cached record, then failed
    before = _reads()
    asyncio.run(_turn(store, "s", 3))
    assert _delta(before) == {"cached": 0, "stale": 0, "redis": 1}
    assert store.get("s").segment.token_ids == [1, 3]  # turn 2's token is nowhere


def test_a_record_written_directly_is_read_again(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    key = f"{prefix}:session:s"
    raw = json.loads(redis_client.get(key))
    raw["metadata"] = {"edited": True}  # same rev, written by something else
    redis_client.set(key, json.dumps(raw))  # json.dumps spaces it: the first bytes differ
    before = _reads()
    asyncio.run(_turn(store, "s", 2))
    assert _delta(before)["stale"] == 1
    assert store.get("s").metadata == {"edited": True}


U1 = {"role": "user", "content": "Plan a trip to France."}


def _traffic(client) -> None:
    """Live branches, an episode with a rewritten history, n > 1 and finishes."""

    def post(sid, messages, **body):
        resp = client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": sid},
            json={"model": "m", "messages": messages, **body},
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]

    r0 = post("live", [U1])
    ra = post("live", [U1, r0, {"role": "user", "content": "A?"}])
    post("live", [U1, r0, {"role": "user", "content": "B?"}])  # a sibling branch
    post(
        "live", [U1, r0, {"role": "user", "content": "A?"}, ra, {"role": "user", "content": "Why?"}]
    )
    client.post("/v1/sessions/live/finish", json={})
    sid = client.post("/v1/sessions", json={"session_id": "ep", "group_id": "g"}).json()[
        "session_id"
    ]
    base = f"/s/{sid}/v1/chat/completions"
    first = client.post(base, json={"model": "m", "messages": [U1]}).json()
    reply = first["choices"][0]["message"]
    client.post(
        base, json={"model": "m", "messages": [U1, reply, {"role": "user", "content": "More?"}]}
    )
    edited = {"role": "assistant", "content": reply["content"] + " (edited)"}
    client.post(
        base,
        json={
            "model": "m",
            "n": 2,
            "messages": [U1, edited, {"role": "user", "content": "Again?"}],
        },
    )
    client.post(f"/v1/sessions/{sid}/rewards", json={"name": "env", "value": 0.5})
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def test_the_same_traffic_publishes_the_same_samples_with_and_without_the_cache(
    redis_client, renderer
):
    published = {}
    for budget in (0, 16 << 20):
        prefix = f"cache{budget}"
        engine = ScriptEngine(renderer, ["Paris.", "Lyon.", "May.", "Nice.", "June."])
        client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
        deps.sessions.cache = RecordCache(budget)
        before = _reads()
        _traffic(client)
        published[budget] = samples()
        if budget:
            assert _delta(before)["cached"] >= 6  # most turns took the held record
        else:
            assert _delta(before)["cached"] == 0
    off, on = published[0], published[16 << 20]
    assert len(off) == len(on) >= 6

    def content(sample):
        return (
            list(sample.token_ids),
            list(sample.loss_mask),
            list(sample.rollout_logprobs),
            list(sample.weight_versions),
            sample.turn_index,
            sample.segment_index,
            [m.content_json for m in sample.messages],
            sample.next_state.content_json,
            dict(sample.rewards),
        )

    assert [content(s) for s in off] == [content(s) for s in on]


def test_owner_checks_use_the_held_record_only_while_it_is_the_stored_one(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s", owner="key-a")

    async def owner_without_reading_the_record() -> str:
        twin = store._loop_clients.get()

        async def no_get(*args, **kwargs):
            raise AssertionError("read the whole record")

        twin.get = no_get
        return await store.aowner("s")

    assert asyncio.run(owner_without_reading_the_record()) == "key-a"
    # The session expires and someone else creates one with the same id elsewhere: this
    # gateway's held record is not that session's, so its owner must not answer.
    redis_client.delete(f"{prefix}:session:s")
    SessionStore(redis_client, prefix, 60).create(session_id="s", owner="key-b")
    assert asyncio.run(store.aowner("s")) == "key-b"
    redis_client.delete(f"{prefix}:session:s")
    with pytest.raises(NotFoundError):
        asyncio.run(store.aowner("s"))


def test_a_turn_with_an_infinite_logprob_reads_back_the_same_from_redis_and_the_cache(
    redis_client, prefix
):
    """An engine that reports no logprob for a token gives -inf (engine_pool.py): the stored
    record keeps it (as "-Infinity"), so a replica reading it from Redis sees what the one
    holding it sees (it used to be stored as null, which did not read back at all)."""
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")

    async def turn() -> None:
        async with locks.locked(store, "s") as record:
            record.segment.append(
                [5, 6], sampled=True, logprobs=[float("-inf"), -0.5], versions=[1, 1]
            )

    asyncio.run(turn())
    assert store.get("s").segment.logprobs == [float("-inf"), -0.5]
