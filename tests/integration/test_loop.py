"""The whole loop through real parts: Redis, engine, gateway, reward and trainer as processes
(started by the same `Stack` that `flywheel up` uses), driven by the official `openai` SDK.

A tiny random-weight Llama with the real SmolLM2 tokenizer stands in for the model, so the loop
runs in seconds; the assertions are about the plumbing, not about learning.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from flywheel.core.codec import decode_sample
from flywheel.core.redis_client import connect
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD
from flywheel.ops.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]
QUESTION = "What is 3 + 4? Answer with just the number."


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model_dir):
    state = tmp_path_factory.mktemp("state")
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": "itest", "block_ms": 200},
        engine={"model_path": str(tiny_model_dir), "port": 31000, "batch_wait_ms": 50},
        gateway={"port": 8800, "default_max_tokens": 12},
        reward={"port": 50151, "metrics_port": 9201},
        trainer={
            "port": 8900,
            "batch": {"groups_per_step": 1, "group_size": 2},
            "optim": {"lr": 1e-3},
            "checkpoint": {"dir": str(state / "ckpt")},
            "logging": {"metrics_path": str(state / "trainer_metrics.jsonl")},
        },
        state_dir=str(state),
    )
    with Stack(settings, echo=lambda _: None) as running:
        yield running, settings


def _urls(stack):
    running, settings = stack
    return {s.name: s.url for s in running.services}, settings


def _episode(gateway: str, group_id: str, temperature: float, outcome: float) -> tuple[str, dict]:
    session = httpx.post(
        f"{gateway}/v1/sessions", json={"group_id": group_id, "task": {"answer": 7}}
    ).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="test")
    completion = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=temperature,
        max_tokens=12,
        logprobs=True,
    )
    finished = httpx.post(
        f"{gateway}/v1/sessions/{session['session_id']}/finish", json={"reward": outcome}
    )
    assert finished.status_code == 200 and finished.json()["samples_published"] == 1
    return session["session_id"], completion.model_dump()


def _wait(predicate, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError("condition not met in time")


def test_two_episodes_train_one_step_and_update_the_engine(stack, tiny_model_dir):
    urls, settings = _urls(stack)
    gateway, engine = urls["gateway"], urls["engine"]
    assert httpx.get(f"{engine}/model_info").json()["weight_version"] == "default"

    # Outcome rewards 1 and 0 give the group a reward spread, hence nonzero GRPO advantages
    # (the tiny random model's replies earn verifier reward 0 either way).
    results = [
        _episode(gateway, "grp-1", 0.0, outcome=1.0),
        _episode(gateway, "grp-1", 1.0, outcome=0.0),
    ]

    client = connect(settings.redis_url())
    rollouts = {}
    for _, fields in client.xrange(settings.streams.key("rollouts")):
        sample = decode_sample(fields[FIELD])
        rollouts[sample.session_id] = sample
    assert set(rollouts) == {sid for sid, _ in results}

    for session_id, completion in results:
        sample = rollouts[session_id]
        n = sample.prompt_length
        sampled = list(sample.token_ids[n:])
        lp_rows = completion["choices"][0]["logprobs"]["content"]
        # Loss mask covers exactly the sampled tokens, which are what the engine returned.
        assert list(sample.loss_mask) == [0] * n + [1] * len(sampled)
        assert len(sampled) == completion["usage"]["completion_tokens"] == len(lp_rows)
        assert list(sample.rollout_logprobs[n:]) == pytest.approx(
            [row["logprob"] for row in lp_rows], abs=1e-6
        )
        assert set(sample.weight_versions[n:]) == {0}
        assert sample.group_id == "grp-1"
        # The engine itself, asked again with the recorded prompt ids, returns the same tokens
        # (greedy episode) and the same logprobs for them.
        if sample.sampling.temperature == 0.0:
            again = httpx.post(
                f"{engine}/generate",
                json={
                    "input_ids": list(sample.token_ids[:n]),
                    "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 12},
                },
            ).json()
            # The trainer may push version 1 while this runs: the engine swaps between decode
            # steps (engine.weight_swap = "step"), so only the tokens before the swap (the
            # span of the initial version) are compared.
            meta = again["meta_info"]
            spans = meta.get("weight_versions") or [
                {"version": meta["weight_version"], "start": 0, "end": len(again["output_ids"])}
            ]
            k = spans[0]["end"] if str(spans[0]["version"]) == "default" else 0
            assert again["output_ids"][:k] == sampled[:k]
            assert [r[0] for r in meta["output_token_logprobs"][:k]] == (
                pytest.approx(list(sample.rollout_logprobs[n : n + k]), abs=1e-4)
            )

    # Reward scored both samples onto the trainer's stream.
    trained = [decode_sample(f[FIELD]) for _, f in client.xrange(settings.streams.key("train"))]
    assert {s.session_id for s in trained} == set(rollouts)
    assert all(s.has_reward and "verifier" in s.rewards for s in trained)
    assert sorted(s.rewards["outcome"] for s in trained) == [0.0, 1.0]

    # The trainer stepped, pushed version 1 to the engine, and acked what it trained on.
    # The trainer pushes the weights before it writes the step's metrics and acks its batch, so
    # each of the three is waited for on its own.
    _wait(lambda: httpx.get(f"{engine}/model_info").json()["weight_version"] == "1")
    metrics = Path(settings.trainer.logging.metrics_path)
    _wait(lambda: metrics.exists() and metrics.read_text().endswith("\n"))
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert lines and lines[-1]["step"] == 1
    _wait(lambda: client.xpending(settings.streams.key("train"), "trainer")["pending"] == 0)

    # The new weights differ from the initial ones.
    latest = sorted(Path(settings.trainer.checkpoint.dir).glob("*/model.safetensors"))[-1]
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(latest)
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed after a training step"


def test_streaming_and_async_clients_get_well_formed_results(stack):
    import asyncio

    urls, _ = _urls(stack)
    gateway = urls["gateway"]
    sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key="test")
    chunks = list(
        sdk.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish in (["stop"], ["length"])
    whole = sdk.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
    )
    assert text == whole.choices[0].message.content  # greedy: same text streamed or not
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    async def ask() -> str:
        client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="test")
        reply = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            temperature=0,
        )
        return reply.choices[0].message.content

    assert asyncio.run(ask()) == text


def test_streamed_turn_in_a_session_carries_the_recorded_logprobs(stack):
    from flywheel.ops.fidelity import check_fidelity

    urls, settings = _urls(stack)
    chunks, sample = _streamed_episode(
        urls["gateway"],
        settings,
        "streamed-solo",
        max_tokens=6,
        temperature=1.0,
        logprobs=True,
        seed=11,
        stop=["###"],
        stream_options={"include_usage": True},
    )
    rows = [
        row
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for row in c.choices[0].logprobs.content
    ]
    n = sample.prompt_length
    # The Sample keeps the sampling params the engine got, the stop strings and seed included.
    assert round(sample.sampling.temperature, 6) == 1.0 and sample.sampling.max_new_tokens == 6
    assert list(sample.sampling.stop) == ["###"]
    assert sample.sampling.has_seed and sample.sampling.seed == 11
    # One streamed row per sampled token, each the logprob the engine sampled it with.
    assert len(rows) == chunks[-1].usage.completion_tokens == len(sample.token_ids) - n
    assert [r.logprob for r in rows] == pytest.approx(list(sample.rollout_logprobs[n:]), abs=1e-6)
    report = check_fidelity(sample, urls["engine"])
    assert report.logprobs_compared and report.max_abs_logprob_diff < 1e-3
    info = httpx.get(f"{urls['gateway']}/v1/sessions/{sample.session_id}").json()
    assert info["forks"] == 0


def _streamed_episode(gateway: str, settings, group_id: str, **request):
    """One streamed turn in a new episode session (a lone group: the trainer waits for more
    members, so the weights stay as they are), finished; (the chunks, the published Sample)."""
    session = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id}).json()
    sdk = openai.OpenAI(base_url=session["base_url"], api_key="test")
    chunks = list(
        sdk.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            stream=True,
            **request,
        )
    )
    finished = httpx.post(
        f"{gateway}/v1/sessions/{session['session_id']}/finish", json={"reward": 0.0}
    )
    assert finished.status_code == 200 and finished.json()["samples_published"] == 1
    client = connect(settings.redis_url())
    (sample,) = [
        s
        for s in (
            decode_sample(f[FIELD]) for _, f in client.xrange(settings.streams.key("rollouts"))
        )
        if s.session_id == session["session_id"]
    ]
    return chunks, sample


def test_streamed_session_turn_arrives_as_sampled_and_is_recorded_as_sent(stack):
    from flywheel.ops.fidelity import check_fidelity

    urls, settings = _urls(stack)
    chunks, sample = _streamed_episode(
        urls["gateway"], settings, "streamed-live", max_tokens=12, temperature=1.0, seed=5
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    # The content came in several deltas (sent while sampled, not whole at the end), and what
    # the client put together is the reply recorded with the engine's own tokens.
    recorded = json.loads(sample.messages[-1].content_json)
    assert len(texts) > 1 and "".join(texts) == recorded
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    report = check_fidelity(sample, urls["engine"])
    assert report.ids_match and report.max_abs_logprob_diff < 1e-3


def test_fidelity_check_rescoring_a_recorded_sample(stack):
    from flywheel.core.versions import parse_weight_version
    from flywheel.ops.fidelity import check_fidelity

    urls, settings = _urls(stack)
    engine = urls["engine"]
    # A lone group: the trainer waits for more members, so the weights stay as they are.
    session_id, _ = _episode(urls["gateway"], "solo", 1.0, outcome=0.0)
    client = connect(settings.redis_url())
    (sample,) = [
        s
        for s in (
            decode_sample(f[FIELD]) for _, f in client.xrange(settings.streams.key("rollouts"))
        )
        if s.session_id == session_id
    ]
    # "default" before any weight update (this test run first or alone): version 0
    version = parse_weight_version(httpx.get(f"{engine}/model_info").json()["weight_version"])
    assert set(sample.weight_versions[sample.prompt_length :]) == {version}
    report = check_fidelity(sample, engine)
    assert report.ids_match and report.logprobs_compared
    assert report.sampled_tokens == len(sample.token_ids) - sample.prompt_length
    assert report.max_abs_logprob_diff < 1e-4, report
    # A tampered record is caught.
    sample.rollout_logprobs[-1] += 0.5
    assert not check_fidelity(sample, engine).ok(1e-4)
