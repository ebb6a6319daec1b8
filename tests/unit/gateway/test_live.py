"""Live mode, header sessions, side turns, posted rewards and n > 1 in a session: the gateway
app with a scripted fake engine, real Redis and the real SmolLM2 tokenizer."""

import json

import pytest

from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app


class ScriptEngine:
    """Replies with the scripted texts in order (+ EOS id 2); logprob -0.1 * (call number)."""

    def __init__(self, renderer, replies):
        self.renderer, self.replies, self.calls = renderer, list(replies), []

    async def generate(self, input_ids, sampling_params, affinity=""):
        text = self.replies[len(self.calls) % len(self.replies)]
        self.calls.append((list(input_ids), dict(sampling_params), affinity))
        ids = self.renderer.encode(text) + [2]
        lp = -0.1 * len(self.calls)
        return Generation(
            output_ids=ids,
            output_logprobs=[lp] * len(ids),
            text=text,
            finish_type="stop",
            matched_eos=True,
            weight_version=len(self.calls),
            prompt_tokens=len(input_ids),
        )


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def env(redis_client, prefix, renderer):
    engine = ScriptEngine(renderer, ["Paris.", "Lyon.", "Nice."])
    client, _, samples = gateway_app(redis_client, prefix, renderer, engine)
    return client, engine, samples


def _post(client, messages, sid=None, turn_type=None, **body):
    headers = {}
    if sid:
        headers["X-Session-Id"] = sid
    if turn_type:
        headers["X-Turn-Type"] = turn_type
    resp = client.post(
        "/v1/chat/completions", headers=headers, json={"model": "m", "messages": messages, **body}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


U1 = {"role": "user", "content": "Capital of France?"}
U2 = {"role": "user", "content": "Wrong, try a city in the south."}


def test_live_session_by_header_emits_one_sample_per_turn_when_its_next_state_arrives(env):
    client, engine, samples = env
    first = _post(client, [U1], sid="chat-1")
    reply1 = first["choices"][0]["message"]
    assert client.get("/v1/sessions/chat-1").json()["mode"] == "live"
    assert samples() == []  # turn 0 waits for its next state
    _post(client, [U1, reply1, U2], sid="chat-1")
    (turn0,) = samples()
    prompt0, prompt1 = engine.calls[0][0], engine.calls[1][0]
    out0 = engine.renderer.encode("Paris.") + [2]
    assert list(turn0.token_ids) == prompt0 + out0
    assert list(turn0.loss_mask) == [0] * len(prompt0) + [1] * len(out0)
    assert turn0.prompt_length == len(prompt0)
    assert turn0.turn_index == 0 and turn0.mode == "live"
    assert turn0.next_state.role == "user"
    assert json.loads(turn0.next_state.content_json) == U2["content"]
    assert [m.role for m in turn0.messages] == ["user", "assistant"]
    assert json.loads(turn0.messages[-1].content_json) == "Paris."
    # Turn 1's prompt holds turn 0's sampled ids exactly; only turn 1 is trainable.
    assert prompt1[: len(prompt0) + len(out0)] == prompt0 + out0
    assert engine.calls[1][2] == "chat-1"  # session affinity
    done = client.post(
        "/v1/sessions/chat-1/finish", json={"next_state": {"role": "user", "content": "Thanks!"}}
    )
    assert done.json()["samples_published"] == 1
    turn1 = samples()[1]
    out1 = engine.renderer.encode("Lyon.") + [2]
    assert list(turn1.token_ids) == prompt1 + out1
    assert list(turn1.loss_mask) == [0] * len(prompt1) + [1] * len(out1)
    assert list(turn1.rollout_logprobs[-len(out1) :]) == pytest.approx([-0.2] * len(out1))
    assert set(turn1.rollout_logprobs[: len(prompt1)]) == {0.0}
    assert set(turn1.weight_versions[: len(prompt1)]) == {-1}
    assert list(turn1.weight_versions[-len(out1) :]) == [2] * len(out1)
    assert turn1.turn_index == 1 and json.loads(turn1.next_state.content_json) == "Thanks!"
    assert turn0.sample_id != turn1.sample_id


def test_live_tool_results_become_one_next_state_and_finish_without_one(env):
    client, _, samples = env
    sid = client.post("/v1/sessions", json={"mode": "live"}).json()["session_id"]
    reply = _post(client, [U1], sid=sid)["choices"][0]["message"]
    tools = [
        {"role": "tool", "tool_call_id": "a", "content": "r1"},
        {"role": "tool", "tool_call_id": "b", "content": "r2"},
    ]
    _post(client, [U1, reply, *tools], sid=sid)
    state = samples()[0].next_state
    assert state.role == "tool" and json.loads(state.content_json) == "r1\n\nr2"
    extra = json.loads(state.extra_json)
    assert extra["tool_call_id"] == "a" and [m["content"] for m in extra["messages"]] == [
        "r1",
        "r2",
    ]
    client.post(f"/v1/sessions/{sid}/finish", json={})
    last = samples()[1]
    assert not last.HasField("next_state")


def test_side_turns_are_served_but_not_recorded(env):
    client, engine, samples = env
    reply = _post(client, [U1], sid="s-side")["choices"][0]["message"]
    side = _post(
        client, [{"role": "user", "content": "Summarize the chat"}], sid="s-side", turn_type="side"
    )
    assert side["choices"][0]["message"]["content"] == "Lyon."
    assert engine.calls[1][2] == "s-side"
    assert samples() == []  # a side turn is not the next state of turn 0
    _post(client, [U1, reply, U2], sid="s-side")
    (turn0,) = samples()
    assert json.loads(turn0.next_state.content_json) == U2["content"]
    info = client.get("/v1/sessions/s-side").json()
    assert info["turns"] == 2 and info["forks"] == 0
    bad = client.post(
        "/v1/chat/completions",
        headers={"X-Turn-Type": "bogus"},
        json={"model": "m", "messages": [U1]},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Turn-Type"
    bad_id = client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": "no spaces"},
        json={"model": "m", "messages": [U1]},
    )
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "X-Session-Id"


def test_posted_rewards_reach_the_sample_rewards_map(env):
    client, _, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    _post(client, [U1], sid=sid)
    posted = client.post(f"/v1/sessions/{sid}/reward", json={"reward": 0.5, "name": "tests"})
    assert posted.status_code == 200 and posted.json()["applies_to"] == "episode"
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert dict(samples()[0].rewards) == {"tests": 0.5, "outcome": 1.0}
    # Live: the reward goes to the turn that waits for its next state.
    reply = _post(client, [U1], sid="live-r")["choices"][0]["message"]
    assert client.post("/v1/sessions/live-r/reward", json={"reward": -1}).status_code == 200
    _post(client, [U1, reply, U2], sid="live-r")
    assert dict(samples()[1].rewards) == {"outcome": -1.0}
    late = client.post("/v1/sessions/nope/reward", json={"reward": 1})
    assert late.status_code == 404
    bad = client.post(
        f"/v1/sessions/{sid}/reward",
        content=b'{"reward": NaN}',
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400
    finished = client.post(f"/v1/sessions/{sid}/reward", json={"reward": 1})
    assert finished.status_code == 409


@pytest.mark.parametrize("mode", ["episode", "live"])
def test_n_choices_in_a_session_the_one_sent_back_continues(env, mode):
    client, engine, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g7", "mode": mode}).json()["session_id"]
    body = client.post(
        f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": [U1], "n": 3, "seed": 5}
    ).json()
    contents = [c["message"]["content"] for c in body["choices"]]
    assert contents == ["Paris.", "Lyon.", "Nice."] and samples() == []
    prompt = engine.calls[0][0]
    chosen = body["choices"][1]["message"]
    client.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": [U1, chosen, U2]})
    published = samples()
    if mode == "episode":  # the others are held until the finish, which publishes them first
        assert published == []
        assert client.get(f"/v1/sessions/{sid}").json()["samples_held"] == 2
        client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.5})
        published = samples()[:2]
        assert all(dict(s.rewards) == {"outcome": 0.5} for s in published)
    closed = published[:2]
    assert [json.loads(s.messages[-1].content_json) for s in closed] == ["Paris.", "Nice."]
    for s, text in zip(closed, ["Paris.", "Nice."], strict=True):
        out = engine.renderer.encode(text) + [2]
        assert list(s.token_ids) == prompt + out
        assert list(s.loss_mask) == [0] * len(prompt) + [1] * len(out)
        assert s.group_id == "g7" and s.turn_index == 0 and not s.HasField("next_state")
    # The chosen choice's ids are in the next prompt, exactly as sampled.
    lyon = engine.renderer.encode("Lyon.") + [2]
    assert engine.calls[3][0][: len(prompt) + len(lyon)] == prompt + lyon
    if mode == "live":  # the chosen turn got its next state from that request
        chosen_turn = published[2]
        assert json.loads(chosen_turn.messages[-1].content_json) == "Lyon."
        assert json.loads(chosen_turn.next_state.content_json) == U2["content"]
        assert list(chosen_turn.token_ids) == prompt + lyon
    if mode == "live":
        client.post(f"/v1/sessions/{sid}/finish", json={})
    final = samples()[len(published) :]
    assert client.get(f"/v1/sessions/{sid}").json()["forks"] == 0
    paris = engine.renderer.encode("Paris.") + [2]
    if mode == "episode":  # the episode holds the chosen choice and the next turn
        (episode,) = final
        assert sum(episode.loss_mask) == len(lyon) + len(paris)
    else:
        (last,) = final
        assert json.loads(last.messages[-1].content_json) == "Paris." and last.turn_index == 1
    assert len({s.sample_id for s in samples()}) == len(samples())


def test_n_choices_never_sent_back_are_all_published_at_finish(env):
    client, _, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    client.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": [U1], "n": 2})
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    published = samples()
    assert [json.loads(s.messages[-1].content_json) for s in published] == ["Paris.", "Lyon."]
    assert all(s.rewards["outcome"] == 1.0 for s in published)
