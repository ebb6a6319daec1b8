"""Live mode through the real stack: an `openai` SDK client names its session with the
`X-Session-Id` header; each assistant turn becomes one Sample once its next state arrives, and
every Sample re-scores on the engine to the same ids and logprobs (fidelity check)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from flywheel.ops.fidelity import check_fidelity

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_turn_live_session_gives_two_faithful_samples(smol_stack):
    sid = "live-two-turns"
    client = openai.OpenAI(
        base_url=f"{smol_stack.gateway}/v1", api_key="local", default_headers={"X-Session-Id": sid}
    )
    messages = [{"role": "user", "content": "Name one fruit."}]
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=1.0, seed=3
    )
    assert smol_stack.session_samples(sid) == []  # turn 0 waits for its next state
    reply = "Now name a vegetable."
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": reply},
    ]
    second = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16, temperature=1.0, seed=4
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    finished = httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={})
    assert finished.json()["samples_published"] == 1
    turn0, turn1 = smol_stack.session_samples(sid)
    assert (turn0.mode, turn0.turn_index, turn1.turn_index) == ("live", 0, 1)
    assert turn0.next_state.role == "user"
    assert json.loads(turn0.next_state.content_json) == reply
    assert not turn1.HasField("next_state")
    assert json.loads(turn0.messages[-1].content_json) == first.choices[0].message.content
    # Turn 1's context holds turn 0's tokens exactly as sampled (no re-tokenization).
    assert list(turn1.token_ids[: len(turn0.token_ids)]) == list(turn0.token_ids)
    assert sum(turn0.loss_mask) == first.usage.completion_tokens
    assert sum(turn1.loss_mask) == second.usage.completion_tokens
    assert turn1.prompt_length == second.usage.prompt_tokens
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{sid}").json()
    assert info["forks"] == 0
    for sample in (turn0, turn1):
        report = check_fidelity(sample, smol_stack.engine)
        assert report.ids_match and report.logprobs_compared
        assert report.ok(1e-3), report


def test_n_choices_in_a_live_session_each_become_a_faithful_sample(smol_stack):
    sid = "live-n-choices"
    client = openai.OpenAI(base_url=f"{smol_stack.gateway}/s/{sid}/v1", api_key="local")
    created = httpx.post(
        f"{smol_stack.gateway}/v1/sessions",
        json={"session_id": sid, "mode": "live", "group_id": "fruit"},
    )
    assert created.status_code == 200
    messages = [{"role": "user", "content": "Name one fruit."}]
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=11,
    )
    assert [c.index for c in first.choices] == [0, 1]
    messages += [
        first.choices[1].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Another one."},
    ]
    client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=1.0, seed=12
    )
    httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={})
    samples = smol_stack.session_samples(sid)
    assert len(samples) == 3 and {s.group_id for s in samples} == {"fruit"}
    unchosen, chosen, last = samples
    assert json.loads(unchosen.messages[-1].content_json) == first.choices[0].message.content
    assert not unchosen.HasField("next_state")
    assert json.loads(chosen.next_state.content_json) == "Another one."
    assert list(last.token_ids[: len(chosen.token_ids)]) == list(chosen.token_ids)
    for sample in samples:
        report = check_fidelity(sample, smol_stack.engine)
        assert report.ids_match and report.ok(1e-3), report
