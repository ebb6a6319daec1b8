"""Live mode with parallel requests in one session (a harness firing sub-calls on the same
history): every request's turn is its own Sample, and a turn's next state comes only from a
later request whose history extends that turn (scripted fake engine, real Redis and tokenizer).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore

from .harness import gateway_app
from .test_live import ScriptEngine

U1 = {"role": "user", "content": "Plan a trip to France."}
UA = {"role": "user", "content": "Sub-task A: pick a city."}
UB = {"role": "user", "content": "Sub-task B: pick a month."}


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def env(redis_client, prefix, renderer):
    engine = ScriptEngine(renderer, ["Paris.", "Lyon.", "May.", "Nice.", "June."])
    client, _, samples = gateway_app(redis_client, prefix, renderer, engine)
    return client, engine, samples


def _post(client, sid, messages):
    resp = client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": sid},
        json={"model": "m", "messages": messages},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def _out(engine, text):
    return engine.renderer.encode(text) + [2]


def _reply(sample):
    return json.loads(sample.messages[-1].content_json)


def _check_own_turn(engine, sample, call, text):
    """The Sample is the engine call's exact prompt + its sampled ids, trainable only there."""
    prompt, out = engine.calls[call][0], _out(engine, text)
    assert list(sample.token_ids) == prompt + out
    assert list(sample.loss_mask) == [0] * len(prompt) + [1] * len(out)
    assert sample.prompt_length == len(prompt) and _reply(sample) == text


def test_sibling_requests_are_branches_with_their_own_next_states(env):
    client, engine, samples = env
    sid = "fan-out"
    r0 = _post(client, sid, [U1])  # call 0: "Paris."
    ra = _post(client, sid, [U1, r0, UA])  # call 1: "Lyon."
    (turn0,) = samples()
    assert json.loads(turn0.next_state.content_json) == UA["content"]
    rb = _post(client, sid, [U1, r0, UB])  # call 2: "May." (a sibling of A)
    assert len(samples()) == 1  # A's turn still waits: B's request does not follow it
    prompt0, out0 = engine.calls[0][0], _out(engine, "Paris.")
    # B continues turn 0 exactly as sampled (no re-tokenized history).
    assert engine.calls[2][0][: len(prompt0) + len(out0)] == prompt0 + out0
    a2 = {"role": "user", "content": "Why Lyon?"}
    _post(client, sid, [U1, r0, UA, ra, a2])  # call 3: "Nice." follows A
    turn_a = samples()[1]
    _check_own_turn(engine, turn_a, 1, "Lyon.")
    assert json.loads(turn_a.next_state.content_json) == a2["content"]
    assert engine.calls[3][0][: len(engine.calls[1][0])] == engine.calls[1][0]
    b2 = {"role": "user", "content": "Why May?"}
    _post(client, sid, [U1, r0, UB, rb, b2])  # call 4: "June." follows B
    turn_b = samples()[2]
    _check_own_turn(engine, turn_b, 2, "May.")
    assert json.loads(turn_b.next_state.content_json) == b2["content"]
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["forks"] == 0 and info["fork_reasons"] == {}
    done = client.post(
        f"/v1/sessions/{sid}/finish", json={"next_state": {"role": "user", "content": "Thanks!"}}
    )
    assert done.json()["samples_published"] == 2  # the latest turn and the other branch's
    last, other = samples()[3:]
    _check_own_turn(engine, last, 4, "June.")
    assert json.loads(last.next_state.content_json) == "Thanks!"
    _check_own_turn(engine, other, 3, "Nice.")
    assert not other.HasField("next_state")
    assert sorted(s.turn_index for s in samples()) == [0, 1, 2, 3, 4]
    assert len({s.sample_id for s in samples()}) == 5


def test_parallel_first_turns_are_two_samples_without_forks(env):
    client, engine, samples = env
    sid = "two-at-once"
    ra = _post(client, sid, [UA])  # "Paris."
    _post(client, sid, [UB])  # "Lyon."
    assert samples() == []
    _post(client, sid, [UA, ra, U1])
    (turn_a,) = samples()
    _check_own_turn(engine, turn_a, 0, "Paris.")
    assert json.loads(turn_a.next_state.content_json) == U1["content"]
    assert client.get(f"/v1/sessions/{sid}").json()["forks"] == 0
    client.post(f"/v1/sessions/{sid}/finish", json={})
    by_reply = {_reply(s): s for s in samples()}
    assert set(by_reply) == {"Paris.", "Lyon.", "May."}
    _check_own_turn(engine, by_reply["Lyon."], 1, "Lyon.")
    assert not by_reply["Lyon."].HasField("next_state")


def test_concurrent_sub_calls_never_take_each_others_next_state(env):
    client, engine, samples = env
    sid = "concurrent"
    r0 = _post(client, sid, [U1])
    subs = [[U1, r0, {"role": "user", "content": f"Sub-task {k}"}] for k in range(4)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda m: _post(client, sid, m), subs))
    client.post(f"/v1/sessions/{sid}/finish", json={})
    published = samples()
    assert len(published) == 5 and client.get(f"/v1/sessions/{sid}").json()["forks"] == 0
    requests = [[U1], *subs]
    for sample in published:
        recorded = [json.loads(m.content_json) for m in sample.messages]
        if sample.HasField("next_state"):  # only turn 0: every sub-call followed it
            assert recorded == [U1["content"], r0["content"]]
            assert json.loads(sample.next_state.content_json) in [s[-1]["content"] for s in subs]
        else:  # each sub-call's own turn, its reply as the client got it
            assert recorded[:-1] in [[m["content"] for m in r] for r in requests]
            assert {"role": "assistant", "content": recorded[-1]} in replies


def test_a_turn_stored_before_checkpoints_existed_still_gets_its_next_state(
    env, redis_client, prefix
):
    client, engine, samples = env
    r0 = _post(client, "legacy", [U1])
    key = f"{prefix}:session:legacy"
    # a record written by a gateway version before checkpoints (and the segment log) existed:
    # all of it in one JSON value
    raw = json.loads(SessionStore(redis_client, prefix, 60).get("legacy").model_dump_json())
    for name in ("checkpoints", "log_tokens", "log_messages"):
        (raw["segment"] if name == "checkpoints" else raw).pop(name)
    raw["rev"] = "0" * 32  # not the version this gateway holds: it reads this one
    redis_client.delete(f"{prefix}:session-log:legacy")
    redis_client.set(key, json.dumps(raw))
    _post(client, "legacy", [U1, r0, UA])
    (turn0,) = samples()
    _check_own_turn(engine, turn0, 0, "Paris.")
    assert json.loads(turn0.next_state.content_json) == UA["content"]


def test_branches_beyond_the_cap_are_published_without_a_next_state(env, caplog):
    from prometheus_client import REGISTRY  # noqa: PLC0415

    from flywheel.gateway.session.branches import MAX_BRANCHES  # noqa: PLC0415

    client, engine, samples = env
    r0 = _post(client, "many", [U1])
    before = (
        REGISTRY.get_sample_value("flywheel_gateway_live_turns_without_next_state_total") or 0.0
    )
    # Turn 0 is followed by sub-call 0; sub-calls 1.. each park the previous latest turn, so
    # after MAX_BRANCHES + 2 sub-calls MAX_BRANCHES + 1 turns wait besides the latest: one
    # too many, and the oldest waiting one (sub-call 0's) is published without a next state.
    with caplog.at_level("WARNING", logger="flywheel.gateway.session.branches"):
        for k in range(MAX_BRANCHES + 2):
            _post(client, "many", [U1, r0, {"role": "user", "content": f"Sub-task {k}"}])
    turn0, sub0 = samples()
    assert json.loads(turn0.next_state.content_json) == "Sub-task 0"
    assert json.loads(sub0.messages[-2].content_json) == "Sub-task 0"
    assert not sub0.HasField("next_state") and sub0.turn_index == 1
    assert any("oldest is published without one" in r.getMessage() for r in caplog.records)
    after = REGISTRY.get_sample_value("flywheel_gateway_live_turns_without_next_state_total")
    assert after == before + 1
    info = client.get("/v1/sessions/many").json()
    assert info["waiting_turns"] == MAX_BRANCHES + 1
    done = client.post("/v1/sessions/many/finish", json={}).json()
    assert done["samples_published"] == MAX_BRANCHES + 1
    assert len({s.sample_id for s in samples()}) == MAX_BRANCHES + 3 == len(samples())


def test_unrelated_conversations_start_segments_and_only_a_rewrite_is_a_fork(env):
    """docs/sessions.md "Forks and segments": in a live session a new conversation rewrites
    nothing (a fresh branch: `segment_index` grows, `forks` does not); a request whose history
    changes a recorded reply is a fork."""
    client, _, _ = env
    sid = "three-conversations"
    _post(client, sid, [U1])  # segment 0: "Paris."
    _post(client, sid, [UA])  # segment 1: "Lyon."
    third = _post(client, sid, [UB])  # segment 2: "May."
    info = client.get(f"/v1/sessions/{sid}").json()
    assert (info["segment_index"], info["forks"], info["fork_reasons"]) == (2, 0, {})
    edited = {**third, "content": "April."}  # "May." as the client rewrote it
    _post(client, sid, [UB, edited, {"role": "user", "content": "Why?"}])
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["segment_index"] == 3
    assert (info["forks"], info["fork_reasons"]) == (1, {"assistant_edited": 1})
