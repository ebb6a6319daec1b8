"""A live turn waiting for its next state is kept as a typed `PendingTurn`, without the
conversation it shares with its segment: the record of a long live session stays small, and the
Sample built from it once, at publish, is the turn's whole Sample (real Redis and tokenizer,
scripted engine)."""

from __future__ import annotations

import json

import pytest

from flywheel.gateway.recording.records import PendingTurn, Segment, SessionRecord
from flywheel.gateway.recording.sample import build_sample, turn_sample

from .harness import gateway_app
from .test_live import ScriptEngine, renderer  # noqa: F401  (the module's fixture)


def _chat(client, sid, messages):
    resp = client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": sid},
        json={"model": "m", "messages": messages, "max_tokens": 16},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]


def test_a_long_live_session_keeps_a_small_pending_turn_and_publishes_whole_samples(
    redis_client, prefix, renderer
):  # noqa: F811
    engine = ScriptEngine(renderer, [f"Reply {i}." for i in range(10)])
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    messages, sizes = [], []
    for i in range(10):
        messages.append({"role": "user", "content": f"result {i}: " + "data line " * 60})
        messages.append(_chat(client, "live", messages))
        stored = json.loads(redis_client.get(f"{prefix}:session:live"))["pending"]
        sizes.append(len(json.dumps(stored)))
    # the 10th turn's waiting turn is stored as small as the 2nd's (its place, sampling...)
    assert sizes[-1] < 1.2 * sizes[1] and sizes[-1] < 600, sizes
    published = samples()
    assert [s.turn_index for s in published] == list(range(9))  # the 10th waits
    for i, sample in enumerate(published):
        prompt, _, _ = engine.calls[i]  # what the engine got for turn i, then its reply
        reply = renderer.encode(f"Reply {i}.") + [2]
        assert list(sample.token_ids) == prompt + reply
        assert list(sample.loss_mask) == [0] * len(prompt) + [1] * len(reply)
        assert list(sample.weight_versions) == [-1] * len(prompt) + [i + 1] * len(reply)
        assert sample.prompt_length == len(prompt)
        assert [json.loads(m.content_json) for m in sample.messages] == [
            m["content"] for m in messages[: 2 * i + 2]
        ]
        assert json.loads(sample.next_state.content_json) == messages[2 * i + 2]["content"]


def test_a_waiting_turn_publishes_the_sample_of_its_segment_cut_at_the_turn(
    redis_client, prefix, renderer
):  # noqa: F811
    engine = ScriptEngine(renderer, ["Paris.", "Lyon."])
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    u1 = {"role": "user", "content": "Capital of France?"}
    r0 = _chat(client, "s", [u1])
    record = deps.sessions.get("s")
    turn = record.pending
    assert (turn.checkpoint, turn.turn_index, turn.choice) == (0, 0, None)
    # the same Sample, built from the whole segment as it was right after the turn
    expected = build_sample(
        record,
        record.segment.upto(0),
        turn_only=True,
        sample_key="turn/0",
        turn_index=0,
        created_at=turn.created_at,  # when the turn was sampled, not when it was published
    )
    u2 = {"role": "user", "content": "And of Italy?"}
    _chat(client, "s", [u1, r0, u2])
    (turn0,) = samples()
    assert json.loads(turn0.next_state.content_json) == u2["content"]
    turn0.ClearField("next_state")
    assert turn0 == expected


def test_a_record_with_a_pending_turn_of_the_earlier_string_form_is_refused(
    redis_client, prefix, renderer
):  # noqa: F811
    """docs/sessions.md: records written by earlier versions are not read; nothing is
    published from such a record and it stays as it was."""
    engine = ScriptEngine(renderer, ["Paris.", "Lyon."])
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    u1 = {"role": "user", "content": "Capital of France?"}
    r0 = _chat(client, "s", [u1])
    key = f"{prefix}:session:s"
    head = json.loads(redis_client.get(key))
    head["pending"] = "0:12:CgJpZA=="  # "<checkpoint>:<start>:<base64 Sample>"
    head["rev"] = "0" * 32  # not what the gateway holds: it reads this record
    redis_client.set(key, json.dumps(head))
    with pytest.raises(ValueError, match="pending"):
        client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": "s"},
            json={"model": "m", "messages": [u1, r0, {"role": "user", "content": "More?"}]},
        )
    assert samples() == []
    assert json.loads(redis_client.get(key))["pending"] == "0:12:CgJpZA=="
    assert not redis_client.exists(f"{prefix}:session-lock:s")  # the lock was released


def test_a_pending_turn_is_built_only_from_a_segment_holding_its_turn():
    seg = Segment()
    seg.append([1, 2, 3], sampled=False)
    seg.append([4, 5], sampled=True, logprobs=[-0.5, -0.25], versions=[7, 7])
    seg.turn_start = 3
    seg.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    seg.turns = 1
    seg.mark_turn()
    record = SessionRecord(session_id="s", mode="live")
    turn = PendingTurn(checkpoint=0, start=3, turn_index=0, rewards={"env": 0.5})
    sample = turn_sample(record, seg, turn)
    assert list(sample.token_ids) == [1, 2, 3, 4, 5]
    assert list(sample.loss_mask) == [0, 0, 0, 1, 1]
    assert list(sample.rollout_logprobs) == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert list(sample.weight_versions) == [-1, -1, -1, 7, 7]
    assert (sample.prompt_length, dict(sample.rewards)) == (3, {"env": 0.5})
    seg.append([6], sampled=False)  # the next request's template ids: the turn is unchanged
    assert turn_sample(record, seg, turn) == sample
    with pytest.raises(ValueError, match="checkpoint 0 of a segment with 0 checkpoints"):
        turn_sample(record, Segment(), turn)
