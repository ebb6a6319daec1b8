"""The session record's segment log (segment_log.py): a save writes what the turn added, not the
whole conversation; a new segment, a changed history or a long log rewrite it; a log that does
not add up is refused; records stored whole by an earlier version still read (real Redis)."""

from __future__ import annotations

import asyncio
import json

import pytest

from flywheel.gateway.recording.records import Segment
from flywheel.gateway.session import locks, segment_log
from flywheel.gateway.session.segment_log import CorruptRecord
from flywheel.gateway.session.store import SessionStore

from .harness import gateway_app
from .test_live import ScriptEngine, renderer  # noqa: F401  (the module's fixture)


def _chunks(redis_client, prefix: str, sid: str) -> list[dict]:
    return [json.loads(c) for c in redis_client.lrange(f"{prefix}:session-log:{sid}", 0, -1)]


async def _turn(store: SessionStore, sid: str, k: int) -> None:
    """Turn k adds the template ids [10k+1], the sampled ids [10k+2, 10k+3] and two messages."""
    async with locks.locked(store, sid) as record:
        seg = record.segment
        seg.append([10 * k + 1], sampled=False)
        seg.append([10 * k + 2, 10 * k + 3], sampled=True, logprobs=[-0.5, -0.25], versions=[k, k])
        seg.messages = [
            *seg.messages,
            {"role": "user", "content": f"q{k}"},
            {"role": "assistant", "content": f"a{k}"},
        ]
        seg.turns += 1
        seg.mark_turn()


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_each_save_appends_only_what_its_turn_added(redis_client, prefix, cache_bytes):
    store = SessionStore(redis_client, prefix, 60, cache_bytes=cache_bytes)
    store.create(session_id="s")
    for k in (1, 2, 3):
        asyncio.run(_turn(store, "s", k))
    # one chunk per turn, each with that turn's 3 tokens and 2 messages only
    assert [c["token_ids"] for c in _chunks(redis_client, prefix, "s")] == [
        [11, 12, 13],
        [21, 22, 23],
        [31, 32, 33],
    ]
    assert [c["loss_mask"] for c in _chunks(redis_client, prefix, "s")] == [[0, 1, 1]] * 3
    assert [[m["content"] for m in c["messages"]] for c in _chunks(redis_client, prefix, "s")] == [
        ["q1", "a1"],
        ["q2", "a2"],
        ["q3", "a3"],
    ]
    head = json.loads(redis_client.get(f"{prefix}:session:s"))
    assert "token_ids" not in head["segment"] and "messages" not in head["segment"]
    assert (head["log_tokens"], head["log_messages"]) == (9, 6)  # 3 turns x 3 tokens, x 2
    whole = SessionStore(redis_client, prefix, 60).get("s")  # another replica reads it all
    assert whole.segment.token_ids == [11, 12, 13, 21, 22, 23, 31, 32, 33]
    assert whole.segment.logprobs == [0.0, -0.5, -0.25] * 3
    assert whole.segment.versions == [-1, 1, 1, -1, 2, 2, -1, 3, 3]
    assert [m["content"] for m in whole.segment.messages] == ["q1", "a1", "q2", "a2", "q3", "a3"]
    assert [cp.tokens for cp in whole.segment.checkpoints] == [3, 6, 9]


def test_a_new_segment_or_a_changed_history_rewrites_the_log(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    asyncio.run(_turn(store, "s", 2))

    async def edit_first_message() -> None:  # a client that rewrote its first question
        async with locks.locked(store, "s") as record:
            seg = record.segment
            seg.messages = [{"role": "user", "content": "q1, edited"}, *seg.messages[1:]]

    asyncio.run(edit_first_message())
    (chunk,) = _chunks(redis_client, prefix, "s")  # rewritten whole: one chunk
    assert chunk["token_ids"] == [11, 12, 13, 21, 22, 23]
    assert [m["content"] for m in chunk["messages"]] == ["q1, edited", "a1", "q2", "a2"]

    async def fork() -> None:  # the next request forked history: a new segment starts
        async with locks.locked(store, "s") as record:
            record.segment = Segment(index=1)
            record.segment.append([7, 8], sampled=False)

    asyncio.run(fork())
    assert [c["token_ids"] for c in _chunks(redis_client, prefix, "s")] == [[7, 8]]
    asyncio.run(_turn(store, "s", 3))
    assert [c["token_ids"] for c in _chunks(redis_client, prefix, "s")] == [[7, 8], [31, 32, 33]]
    assert SessionStore(redis_client, prefix, 60).get("s").segment.token_ids == [7, 8, 31, 32, 33]


def test_a_long_log_is_rewritten_as_one_chunk(redis_client, prefix, monkeypatch):
    monkeypatch.setattr(segment_log, "MAX_CHUNKS", 3)
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    lengths = []
    for k in range(1, 6):
        asyncio.run(_turn(store, "s", k))
        lengths.append([len(c["token_ids"]) for c in _chunks(redis_client, prefix, "s")])
    # 3 chunks of 3 tokens, then the 4th save rewrites: one chunk of 12, then 12 + 3
    assert lengths == [[3], [3, 3], [3, 3, 3], [12], [12, 3]]
    assert len(SessionStore(redis_client, prefix, 60).get("s").segment.token_ids) == 15


def test_a_log_that_does_not_add_up_is_refused(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    asyncio.run(_turn(store, "s", 2))
    redis_client.lpop(f"{prefix}:session-log:s")  # a chunk lost
    with pytest.raises(
        CorruptRecord, match="holds 3 tokens and 2 messages, its record says 6 and 4"
    ):
        store.get("s")


def test_a_record_stored_whole_by_an_earlier_version_reads_and_then_appends(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    whole = json.loads(store.get("s").model_dump_json(exclude={"log_tokens", "log_messages"}))
    whole["rev"] = "0" * 32
    redis_client.set(f"{prefix}:session:s", json.dumps(whole))  # one JSON value, no log
    redis_client.delete(f"{prefix}:session-log:s")
    assert store.get("s").segment.token_ids == [11, 12, 13]
    asyncio.run(_turn(store, "s", 2))  # the first save moves what it read into the log
    assert [c["token_ids"] for c in _chunks(redis_client, prefix, "s")] == [
        [11, 12, 13, 21, 22, 23]
    ]
    assert "token_ids" not in json.loads(redis_client.get(f"{prefix}:session:s"))["segment"]
    assert store.get("s").segment.token_ids == [11, 12, 13, 21, 22, 23]


def test_a_record_stored_whole_beside_a_log_of_this_version_reads_whole(redis_client, prefix):
    """An earlier gateway saved the record whole while this version's log of it was left: the
    head is the record; the next save rewrites the log."""
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    asyncio.run(_turn(store, "s", 2))
    whole = json.loads(store.get("s").model_dump_json(exclude={"log_tokens", "log_messages"}))
    whole["rev"] = "0" * 32
    whole["segment"]["token_ids"] = [5, 6, 7, 8, 9, 10]  # what the earlier version saved
    redis_client.set(f"{prefix}:session:s", json.dumps(whole))
    assert store.get("s").segment.token_ids == [5, 6, 7, 8, 9, 10]
    asyncio.run(_turn(store, "s", 3))
    assert [c["token_ids"] for c in _chunks(redis_client, prefix, "s")] == [
        [5, 6, 7, 8, 9, 10, 31, 32, 33]
    ]


def test_an_unreadable_record_is_refused_and_its_lock_released(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60, cache_bytes=0)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))
    redis_client.rpush(f"{prefix}:session-log:s", json.dumps({"token_ids": [1]}))
    for _ in range(2):  # not busy the second time: the first left no lock
        with pytest.raises(CorruptRecord):
            asyncio.run(_turn(store, "s", 2))
        assert not redis_client.exists(f"{prefix}:session-lock:s")
    with pytest.raises(CorruptRecord):
        store.try_acquire("s")
    assert not redis_client.exists(f"{prefix}:session-lock:s")


def test_a_record_that_expires_during_a_turn_is_saved_whole(redis_client, prefix, caplog):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    asyncio.run(_turn(store, "s", 1))

    async def turn_outliving_its_record() -> None:
        async with locks.locked(store, "s") as record:
            redis_client.delete(f"{prefix}:session:s", f"{prefix}:session-log:s")  # TTL
            record.segment.append([21], sampled=False)

    asyncio.run(turn_outliving_its_record())
    assert SessionStore(redis_client, prefix, 60).get("s").segment.token_ids == [11, 12, 13, 21]
    assert "expired while a turn ran" in caplog.text


def test_history_resent_in_another_json_form_rewrites_the_log(redis_client, prefix):
    """Equal to Python (`{"a": 1, "b": 2} == {"b": 2.0, "a": 1}`) but not as stored: the
    log is rewritten with the form the record now holds, so every replica reads that form."""
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    first = {"role": "user", "content": "q", "meta": {"a": 1, "b": 2}}

    async def turn(messages) -> str:
        async with locks.locked(store, "s") as record:
            record.segment.append([len(messages)], sampled=False)
            record.segment.messages = messages
            return record.segment.model_dump_json()

    asyncio.run(turn([first]))
    held = asyncio.run(
        turn(
            [
                {"role": "user", "content": "q", "meta": {"b": 2.0, "a": 1}},
                {"role": "assistant", "content": "a"},
            ]
        )
    )
    assert len(_chunks(redis_client, prefix, "s")) == 1  # rewritten
    stored = SessionStore(redis_client, prefix, 60, cache_bytes=0).get("s")
    assert stored.segment.model_dump_json() == held
    assert stored.segment.messages[0]["meta"] == {"b": 2.0, "a": 1}


@pytest.mark.parametrize("suffix", [":log", ":lock"])
def test_session_ids_naming_another_sessions_log_or_lock_are_their_own(
    redis_client, prefix, suffix
):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id=f"a{suffix}")
    asyncio.run(_turn(store, f"a{suffix}", 1))
    store.create(session_id="a")
    asyncio.run(_turn(store, "a", 2))
    asyncio.run(_turn(store, f"a{suffix}", 3))
    other = SessionStore(redis_client, prefix, 60)
    assert other.get(f"a{suffix}").segment.token_ids == [11, 12, 13, 31, 32, 33]
    assert other.get("a").segment.token_ids == [21, 22, 23]


def test_creating_a_session_drops_a_log_left_under_its_id(redis_client, prefix):
    redis_client.rpush(f"{prefix}:session-log:s", json.dumps({"token_ids": [1]}))
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")
    assert SessionStore(redis_client, prefix, 60).get("s").segment.token_ids == []
    asyncio.run(_turn(store, "s", 1))
    assert SessionStore(redis_client, prefix, 60).get("s").segment.token_ids == [11, 12, 13]


def test_a_growing_conversation_writes_per_turn_what_the_turn_added(redis_client, prefix, renderer):  # noqa: F811
    """Through the gateway (real tokenizer): 12 turns each adding a ~600-character tool
    result. The record grows with the conversation; what each save writes does not."""
    engine = ScriptEngine(renderer, [f"Reply {i}." for i in range(12)])
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    messages, written = [], []
    for i in range(12):
        messages.append({"role": "user", "content": f"result {i}: " + "data line " * 60})
        resp = client.post(
            f"/s/{sid}/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 16},
        )
        assert resp.status_code == 200, resp.text
        messages.append(resp.json()["choices"][0]["message"])
        last = redis_client.lindex(f"{prefix}:session-log:{sid}", -1)
        written.append(len(redis_client.get(f"{prefix}:session:{sid}")) + len(last))
    whole = len(deps.sessions.get(sid).model_dump_json())
    assert whole > 20_000  # 12 x (~600 characters, ~130 tokens)
    # the 12th save wrote about what the 2nd did (its head holds a checkpoint per turn, ~90
    # bytes each), a small part of the record
    assert written[-1] < 1.5 * written[1] and written[-1] < whole / 5, (written, whole)
    assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    (sample,) = samples()
    assert list(sample.token_ids) == deps.sessions.get(sid).segment.token_ids
    assert sum(sample.loss_mask) == sum(
        len(renderer.encode(f"Reply {i}.")) + 1  # + EOS
        for i in range(12)
    )
