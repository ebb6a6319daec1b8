"""Live mode through the real stack (real engine serving SmolLM2, real gateway process): a
harness fires parallel sub-calls on one history with the `openai` SDK; raw completions are
recorded in a live session too. Every turn is its own Sample, re-scores on the engine to the
same ids and logprobs, and takes its next state only from a request that extends it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from flywheel.ops.fidelity import check_fidelity

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"


def _faithful(sample, engine):
    report = check_fidelity(sample, engine)
    assert report.ids_match and report.logprobs_compared, report
    assert report.ok(1e-3), report


def test_parallel_sub_calls_are_faithful_branches(smol_stack):
    sid = "live-fan-out"
    client = openai.OpenAI(
        base_url=f"{smol_stack.gateway}/v1", api_key="local", default_headers={"X-Session-Id": sid}
    )
    history = [{"role": "user", "content": "Name one fruit."}]
    first = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=12, temperature=1.0, seed=1
    )
    history.append(first.choices[0].message.model_dump(exclude_none=True))
    subs = [
        [*history, {"role": "user", "content": f"Now name a {kind}."}]
        for kind in ("vegetable", "colour", "city")
    ]

    def call(messages):
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=2
        )

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(call, subs))
    done = httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={}, timeout=60).json()
    assert done["samples_published"] == 3  # the three sub-call turns; turn 0 went before
    samples = smol_stack.session_samples(sid)
    assert sorted(s.turn_index for s in samples) == [0, 1, 2, 3]
    turn0 = next(s for s in samples if s.turn_index == 0)
    assert json.loads(turn0.next_state.content_json) in [m[-1]["content"] for m in subs]
    assert sum(turn0.loss_mask) == first.usage.completion_tokens
    by_reply = {json.loads(s.messages[-1].content_json): s for s in samples if s.turn_index}
    for reply, messages in zip(replies, subs, strict=True):
        sample = by_reply[reply.choices[0].message.content]
        assert not sample.HasField("next_state")
        assert json.loads(sample.messages[-2].content_json) == messages[-1]["content"]
        assert sum(sample.loss_mask) == reply.usage.completion_tokens
        assert sample.prompt_length == reply.usage.prompt_tokens
        # Each sub-call's context holds turn 0's tokens exactly as sampled.
        assert list(sample.token_ids[: len(turn0.token_ids)]) == list(turn0.token_ids)
    info = httpx.get(f"{smol_stack.gateway}/v1/sessions/{sid}", timeout=60).json()
    assert info["forks"] == 0
    for sample in samples:
        _faithful(sample, smol_stack.engine)


def test_raw_completions_in_a_live_session_are_faithful_turns(smol_stack):
    sid = "live-raw"
    url = f"{smol_stack.gateway}/v1/completions"
    headers = {"X-Session-Id": sid}
    body = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 5}
    first = httpx.post(
        url, headers=headers, json={**body, "prompt": "One, two,"}, timeout=120
    ).json()
    follow = "\nThree, four,"
    text = "One, two," + first["choices"][0]["text"] + follow
    second = httpx.post(url, headers=headers, json={**body, "prompt": text}, timeout=120)
    assert second.status_code == 200, second.text
    httpx.post(f"{smol_stack.gateway}/v1/sessions/{sid}/finish", json={}, timeout=60)
    turn0, turn1 = smol_stack.session_samples(sid)
    assert json.loads(turn0.next_state.content_json) == follow
    assert not turn1.HasField("next_state")
    assert list(turn1.token_ids[: len(turn0.token_ids)]) == list(turn0.token_ids)
    assert sum(turn0.loss_mask) == first["usage"]["completion_tokens"]
    for sample in (turn0, turn1):
        _faithful(sample, smol_stack.engine)
