"""Two gateway processes on one Redis serve the same episode, its turns alternating between them
(a load balancer without session affinity): each replica's cached record goes stale when the
other saves a turn, and the episode is recorded exactly as on one gateway (openai SDK, stub
engine, real Redis)."""

from __future__ import annotations

import re

import httpx
from openai import OpenAI

from flywheel.core.codec import decode_sample
from flywheel.core.streams import FIELD


def _episode(route: list[str]) -> str:
    """Create a session on route[0], one chat turn on each gateway of `route`, finish it on the
    last; returns the session id."""
    sid = httpx.post(f"{route[0]}/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    messages = [{"role": "user", "content": "What is 7 + 1?"}]
    for gw in route:
        client = OpenAI(base_url=f"{gw}/s/{sid}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "And then?"},
        ]
    done = httpx.post(f"{route[-1]}/v1/sessions/{sid}/finish", json={}).json()
    assert done["samples_published"] == 1, done
    info = httpx.get(f"{route[0]}/v1/sessions/{sid}").json()
    assert info["forks"] == 0, info
    return sid


def _reads(gw: str) -> dict[str, float]:
    text = httpx.get(f"{gw}/metrics").text
    return {
        m[1]: float(m[2])
        for m in re.finditer(
            r'^flywheel_gateway_record_reads_total\{source="(\w+)"\} ([0-9.e+]+)$', text, re.M
        )
    }


def test_turns_alternating_between_two_gateways_record_the_same_episode_as_one(
    procs, redis_server, redis_client, prefix, tiny_model_dir
):
    stub = procs.stub("ok")
    a = procs.gateway(redis_server.url, prefix, [stub], tiny_model_dir)
    b = procs.gateway(redis_server.url, prefix, [stub], tiny_model_dir)
    split = _episode([a, b, a, a, b, b])
    alone = _episode([a] * 6)

    samples = {
        s.session_id: s
        for s in (decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts"))
    }
    one, two = samples[alone], samples[split]
    assert list(two.token_ids) == list(one.token_ids)
    assert list(two.loss_mask) == list(one.loss_mask) and sum(one.loss_mask) > 6
    assert list(two.rollout_logprobs) == list(one.rollout_logprobs)
    assert [m.content_json for m in two.messages] == [m.content_json for m in one.messages]
    # a: created `split` (held), turn 1 held, b saved turn 2: turn 3 stale, turn 4 held (2
    # held + 1 stale); `alone` created on a: 6 turns and the finish held (7). b: turn 2 first
    # read from Redis, a saved turns 3-4: turn 5 stale, turn 6 and the finish held.
    reads_a, reads_b = _reads(a), _reads(b)
    assert (reads_a.get("cached"), reads_a.get("stale"), reads_a.get("redis")) == (9, 1, 0)
    assert (reads_b.get("cached"), reads_b.get("stale"), reads_b.get("redis")) == (2, 1, 1)
