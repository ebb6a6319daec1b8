"""A live turn waiting for its next state is kept without the conversation it shares with its
segment (pending.py): the record of a long live session stays small, the Sample published is
the turn's whole Sample, and one stored whole by an earlier version still publishes (real
Redis and tokenizer, scripted engine)."""

from __future__ import annotations

import base64
import json

import pytest

from flywheel.core.codec import encode_sample
from flywheel.gateway.recording.records import Segment
from flywheel.gateway.session import pending

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
        sizes.append(len(json.loads(redis_client.get(f"{prefix}:session:live"))["pending"]))
    # the 10th turn's waiting Sample is stored as small as the 2nd's (ids, seed, sampling...)
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


def test_a_pending_turn_stored_whole_by_an_earlier_version_still_publishes(
    redis_client, prefix, renderer
):  # noqa: F811
    engine = ScriptEngine(renderer, ["Paris.", "Lyon."])
    client, deps, samples = gateway_app(redis_client, prefix, renderer, engine)
    u1 = {"role": "user", "content": "Capital of France?"}
    r0 = _chat(client, "s", [u1])
    record = deps.sessions.get("s")
    whole = pending.restore(record.pending, record.segment)
    key = f"{prefix}:session:s"
    head = json.loads(redis_client.get(key))
    head["pending"] = base64.b64encode(encode_sample(whole)).decode()  # the old form
    head["rev"] = "0" * 32  # not what the gateway holds: it reads this record
    redis_client.set(key, json.dumps(head))
    _chat(client, "s", [u1, r0, {"role": "user", "content": "And of Italy?"}])
    (turn0,) = samples()
    turn0.ClearField("next_state")
    assert turn0 == whole


def test_a_pending_turn_is_restored_only_from_a_segment_holding_its_turn():
    seg = Segment()
    seg.append([1, 2, 3], sampled=False)
    seg.append([4, 5], sampled=True, logprobs=[-0.5, -0.25], versions=[7, 7])
    seg.turn_start = 3
    seg.messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    seg.turns = 1
    seg.mark_turn()
    stored = f"0:3:{base64.b64encode(b'').decode()}"
    sample = pending.restore(stored, seg)
    assert list(sample.token_ids) == [1, 2, 3, 4, 5]
    assert list(sample.loss_mask) == [0, 0, 0, 1, 1]
    assert list(sample.rollout_logprobs) == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert list(sample.weight_versions) == [-1, -1, -1, 7, 7]
    seg.append([6], sampled=False)  # the next request's template ids: the turn is unchanged
    assert pending.restore(stored, seg) == sample
    with pytest.raises(ValueError, match="checkpoint 0 of a segment with 0 checkpoints"):
        pending.restore(stored, Segment())
