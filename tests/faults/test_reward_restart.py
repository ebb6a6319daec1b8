"""Kill -9 the reward service while it scores a backlog and start it again: every published
Sample reaches the train stream (at least once; a copy written just before the kill may appear
twice and the trainer drops it as a duplicate by sample_id), nothing is dead-lettered and nothing
stays pending."""

from __future__ import annotations

import time

from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.streams import FIELD, StreamProducer

N = 40


def _publish(producer: StreamProducer, n: int, published: set[str]) -> None:
    for _ in range(n):
        sample = new_sample(
            token_ids=[5, 6, 7],
            loss_mask=[0, 1, 1],
            rollout_logprobs=[0.0, -0.1, -0.2],
            weight_versions=[-1, 0, 0],
            group_id=f"g{len(published)}",
            task_json='{"answer": 7}',
        )
        producer.publish(sample)
        published.add(sample.sample_id)


def test_reward_crash_loses_no_sample(procs, redis_server, redis_client, prefix):
    rollouts, train = f"{prefix}:rollouts", f"{prefix}:train"
    producer = StreamProducer(redis_client, rollouts)
    published: set[str] = set()
    streams = {"min_idle_ms": 500}  # a dead consumer's entries are reclaimed after 0.5 s
    # The kill must land mid-backlog. On a loaded machine the service may score a whole backlog
    # between two polls of this thread; then a larger backlog is added and the service started
    # and killed again (the earlier crash is still part of the run), up to 5 tries.
    n, kills = N, 0
    for _ in range(5):
        _publish(producer, n, published)
        target = redis_client.xlen(train) + n // 4
        first = procs.reward(redis_server.url, prefix, streams=streams)
        deadline = time.monotonic() + 60
        while redis_client.xlen(train) < target and time.monotonic() < deadline:
            time.sleep(0.005)
        kills += 1
        procs.kill(first)  # mid-backlog, possibly between writing `train` and acking `rollouts`
        done = {decode_sample(f[FIELD]).sample_id for _, f in redis_client.xrange(train)}
        if done != published:
            break
        n *= 4
    assert done != published, "every backlog finished before its crash"
    procs.reward(redis_server.url, prefix, streams=streams)
    deadline = time.monotonic() + 90
    seen: set[str] = set()
    while seen != published and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = {decode_sample(f[FIELD]).sample_id for _, f in redis_client.xrange(train)}
    assert seen == published  # every Sample arrived
    copies = redis_client.xlen(train) - len(seen)
    assert copies <= 16 * kills  # duplicates only from entries in flight at a kill (max_in_flight)
    assert redis_client.xlen(f"{prefix}:dead") == 0
    deadline = time.monotonic() + 30
    while redis_client.xpending(rollouts, "reward")["pending"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert redis_client.xpending(rollouts, "reward")["pending"] == 0
