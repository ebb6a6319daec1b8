"""Episode mode: Samples made before the finish (a segment closed by a fork, n > 1 choices not
continued) are held in Redis until the finish publishes them with the episode's outcome and
posted rewards (fake engine, real Redis and tokenizer)."""

import pytest
from prometheus_client import REGISTRY

from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app
from .test_app import FakeEngine

ASK = [{"role": "user", "content": "What is 7 + 1?"}]
EDITED = [{"role": "user", "content": "something else entirely"}]


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def app(redis_client, prefix, renderer):
    client, deps, samples = gateway_app(redis_client, prefix, renderer, FakeEngine(renderer))
    return client, samples, redis_client, prefix


@pytest.fixture
def capped(redis_client, prefix, renderer):
    """A gateway whose episode sessions may hold 2 Samples for the finish."""
    engine = FakeEngine(renderer)
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    deps.settings = deps.settings.model_copy(update={"max_held_samples": 2})
    return client, samples, engine


def _forked_episode(client):
    """An episode whose second request edits history: segment 0 is closed by a fork."""
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    for messages in (ASK, EDITED):
        assert (
            client.post(
                f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": messages}
            ).status_code
            == 200
        )
    return sid


def test_a_forked_segment_is_held_and_published_with_the_outcome(app):
    client, samples, redis_client, prefix = app
    sid = _forked_episode(client)
    assert (
        client.post(
            f"/v1/sessions/{sid}/reward", json={"name": "style", "reward": 0.25}
        ).status_code
        == 200
    )
    info = client.get(f"/v1/sessions/{sid}").json()
    assert (info["forks"], info["samples_held"], info["samples_published"]) == (1, 1, 0)
    assert samples() == []  # nothing reaches the trainer's stream before the outcome
    assert redis_client.llen(f"{prefix}:session-held:{sid}") == 1
    finished = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).json()
    assert finished["samples_published"] == 2
    published = samples()
    assert [s.segment_index for s in published] == [0, 1]
    assert all(dict(s.rewards) == {"outcome": 1.0, "style": 0.25} for s in published)
    assert all(sum(s.loss_mask) == 2 for s in published)  # "8" + EOS sampled in each
    assert not redis_client.exists(f"{prefix}:session-held:{sid}")
    assert client.get(f"/v1/sessions/{sid}").json()["samples_held"] == 0
    # A repeated finish publishes nothing again.
    again = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).json()
    assert again["replayed"] and len(samples()) == 2


def test_held_samples_gone_at_the_finish_are_counted(app):
    client, samples, redis_client, prefix = app
    sid = _forked_episode(client)
    redis_client.delete(f"{prefix}:session-held:{sid}")  # e.g. expired apart from the record
    before = REGISTRY.get_sample_value("flywheel_gateway_held_samples_lost_total") or 0
    finished = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.0}).json()
    assert finished["samples_published"] == 1  # the last segment still goes out
    assert [s.segment_index for s in samples()] == [1]
    assert REGISTRY.get_sample_value("flywheel_gateway_held_samples_lost_total") == before + 1


def test_an_unreadable_held_entry_is_counted_and_the_others_published(app):
    client, samples, redis_client, prefix = app
    sid = _forked_episode(client)
    client.post(
        f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": ASK}
    )  # fork 2: 2 held
    assert client.get(f"/v1/sessions/{sid}").json()["samples_held"] == 2
    redis_client.lset(f"{prefix}:session-held:{sid}", 0, b"not a Sample")  # segment 0 spoilt
    before = REGISTRY.get_sample_value("flywheel_gateway_held_samples_lost_total") or 0
    finished = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.0}).json()
    assert finished["samples_published"] == 2  # segment 1 (held) and the open segment 2
    assert [s.segment_index for s in samples()] == [1, 2]
    assert REGISTRY.get_sample_value("flywheel_gateway_held_samples_lost_total") == before + 1


def test_a_new_session_with_a_used_id_starts_without_held_samples(app):
    client, samples, redis_client, prefix = app
    sid = "reused-id"
    redis_client.rpush(f"{prefix}:session-held:{sid}", b"left by an earlier session")
    assert client.post("/v1/sessions", json={"session_id": sid}).status_code == 200
    assert not redis_client.exists(f"{prefix}:session-held:{sid}")
    assert (
        client.post(
            f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": ASK}
        ).status_code
        == 200
    )
    assert client.post(f"/v1/sessions/{sid}/finish", json={}).json()["samples_published"] == 1


def test_the_held_list_lives_as_long_as_the_record(app):
    client, samples, redis_client, prefix = app
    sid = _forked_episode(client)
    ttl = redis_client.ttl(f"{prefix}:session-held:{sid}")
    assert 3500 < ttl <= 3600  # the store's session TTL (harness: 3600 s), renewed per save
    assert abs(ttl - redis_client.ttl(f"{prefix}:session:{sid}")) <= 1


def test_a_turn_that_would_hold_too_many_samples_is_refused_and_nothing_is_lost(capped):
    client, samples, engine = capped
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    chat = f"/s/{sid}/v1/chat/completions"
    # ASK, EDITED, ASK: two forks close segments 0 and 1 -> 2 held, the limit.
    for messages in (ASK, EDITED, ASK):
        assert client.post(chat, json={"model": "m", "messages": messages}).status_code == 200
    assert client.get(f"/v1/sessions/{sid}").json()["samples_held"] == 2
    before = REGISTRY.get_sample_value("flywheel_gateway_held_refused_total") or 0
    generated = len(engine.prompts)
    refused = client.post(chat, json={"model": "m", "messages": EDITED})  # a third fork: 3 > 2
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_held_samples", "session_id")
    assert "finish" in error["message"]
    assert len(engine.prompts) == generated  # refused before the engine was asked
    assert REGISTRY.get_sample_value("flywheel_gateway_held_refused_total") == before + 1
    info = client.get(f"/v1/sessions/{sid}").json()
    assert (info["samples_held"], info["forks"], info["turns"]) == (2, 2, 3)
    # A turn that extends the open segment sets nothing aside and is served.
    reply = [*ASK, {"role": "assistant", "content": "8"}, {"role": "user", "content": "And 2+2?"}]
    assert client.post(chat, json={"model": "m", "messages": reply}).status_code == 200
    finished = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).json()
    assert finished["samples_published"] == 3
    assert [s.segment_index for s in samples()] == [0, 1, 2]
    assert sum(samples()[2].loss_mask) == 4  # the open segment's two turns, "8" + EOS each
