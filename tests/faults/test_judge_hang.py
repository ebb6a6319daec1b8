"""A judge that accepts connections and never answers: the reward stream is not stuck. Every turn
Sample reaches the train stream within the bounded retry budget, marked unjudged (never a fake
0), and nothing stays pending or is dead-lettered (field failures BUG-22)."""

from __future__ import annotations

import time

import httpx

from flywheel.core.codec import decode_sample
from flywheel.core.streams import FIELD

CHAT = {"model": "m", "max_tokens": 8}


def test_hanging_judge_gives_unjudged_samples_in_bounded_time(
    procs, inproc_gateway, redis_server, redis_client, prefix
):
    judge = procs.stub("hang")
    procs.reward(
        redis_server.url,
        prefix,
        judge={
            "enabled": True,
            "base_url": f"{judge}/v1",
            "timeout_s": 0.5,
            "max_attempts": 2,
            "backoff_s": 0.05,
            "votes": 2,
        },
    )
    gw = inproc_gateway([procs.stub("ok")])
    turns = 3
    with httpx.Client(base_url=gw, timeout=30) as http:
        msgs = [{"role": "user", "content": "Hi"}]
        for i in range(turns + 1):  # each next request is the previous turn's next state
            reply = http.post(
                "/v1/chat/completions",
                headers={"X-Session-Id": "live-1"},
                json={**CHAT, "messages": msgs},
            )
            assert reply.status_code == 200, reply.text
            msgs += [
                reply.json()["choices"][0]["message"],
                {"role": "user", "content": f"and {i}?"},
            ]
    t0 = time.monotonic()
    train = f"{prefix}:train"
    # budget: 2 attempts x 0.5 s + backoff per vote, votes concurrent: ~1.2 s; allow start-up
    while redis_client.xlen(train) < turns and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    samples = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(train)]
    assert len(samples) == turns
    for s in samples:
        assert not s.has_reward and s.error.startswith("unjudged:"), s.error
        assert "judge" not in s.rewards  # no fabricated judge score
    assert procs.calls(judge) >= turns * 2  # every vote was tried...
    assert procs.calls(judge) <= turns * 2 * 2  # ...and retried at most max_attempts times
    assert redis_client.xpending(f"{prefix}:rollouts", "reward")["pending"] == 0
    assert redis_client.xlen(f"{prefix}:dead") == 0
