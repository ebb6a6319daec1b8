"""Backpressure end to end with a real reward process and no trainer: the train stream fills to
its high-water mark, the reward service stops reading rollouts, their lag reaches the gateway's
mark and new training sessions get 429 with Retry-After (eval sessions are still served). Nothing
is trimmed or dead-lettered; when the trainer resumes everything flows and the counts add up."""

from __future__ import annotations

import time

import httpx

from flywheel.core.streams import StreamConsumer

HIGH = 4
CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "7 + 1?"}]}


def _episode(http: httpx.Client, **body) -> httpx.Response:
    created = http.post("/v1/sessions", json={"group_id": "g", "task": {"answer": 8}, **body})
    if created.status_code != 200:
        return created
    sid = created.json()["session_id"]
    assert http.post(f"/s/{sid}/v1/chat/completions", json=CHAT).status_code == 200
    return http.post(f"/v1/sessions/{sid}/finish", json={})


def _wait(cond, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_trainer_stop_reaches_the_gateway_as_429_and_nothing_is_lost(
    procs, inproc_gateway, redis_server, redis_client, prefix
):
    procs.reward(redis_server.url, prefix, streams={"high_water": HIGH})
    gw = inproc_gateway([procs.stub("ok")], high_water=HIGH)
    rollouts, train, dead = (f"{prefix}:{s}" for s in ("rollouts", "train", "dead"))
    finished = 0
    with httpx.Client(base_url=gw, timeout=30) as http:
        for _ in range(4 * HIGH):
            resp = _episode(http)
            if resp.status_code == 429:
                break
            assert resp.status_code == 200, resp.text
            finished += 1
            _wait(lambda n=min(finished, HIGH): redis_client.xlen(train) >= n)
        assert resp.status_code == 429, "the gateway never applied backpressure"
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.json()["error"]["code"] == "backpressure"
        assert finished == 2 * HIGH  # HIGH in train + HIGH waiting unread in rollouts
        assert _episode(http, eval=True).status_code == 200  # evaluation is still served

        # nothing trimmed, nothing dead-lettered, everything accounted for
        assert redis_client.xlen(rollouts) == finished
        assert redis_client.xlen(train) == HIGH
        assert redis_client.xlen(dead) == 0

        # the trainer resumes: reads and acks; the backlog drains and sessions open again
        trainer = StreamConsumer(redis_client, train, "trainer", "t1", dead_stream=dead)
        trained: set[str] = set()

        def consume(target: int) -> bool:
            batch = trainer.read(count=16, block_ms=50)
            trained.update(e.sample.sample_id for e in batch)
            trainer.ack([e.entry_id for e in batch])
            return len(trained) >= target

        _wait(lambda: consume(finished))
        assert _episode(http).status_code == 200
    published = redis_client.xlen(rollouts)
    _wait(lambda: consume(published))
    assert len(trained) == published == finished + 1  # published = trained, none dropped
    assert redis_client.xlen(dead) == 0
