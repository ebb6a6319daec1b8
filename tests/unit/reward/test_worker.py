"""The stream worker against a real Redis and a fake judge over real HTTP that hangs, returns
500 or returns garbage for some samples: the others flow through, each entry is acked when done,
stuck entries are reclaimed, poison entries are dead-lettered after N failures."""

import asyncio
import json
import socket

import pytest

from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.judge_client import AsyncJudgeClient, JudgeCallError, judge_metrics
from flywheel.core.streams import FIELD, StreamConsumer, StreamProducer
from flywheel.reward.judge import NextStateJudge
from flywheel.reward.scoring import Scorer, is_unjudged
from flywheel.reward.worker import RewardWorker


def _turn(reply, sample_id):
    s = new_sample(task_json=json.dumps({"answer": 8}), sample_id=sample_id)
    s.messages.add(role="user", content_json=json.dumps("What is 7 + 1?"))
    s.messages.add(role="assistant", content_json=json.dumps(reply))
    s.next_state.role = "user"
    s.next_state.content_json = json.dumps("thanks")
    return s


def _stage(redis_client, prefix, scorer, consumer_name="c1", min_idle_ms=60_000, **kw):
    consumer = StreamConsumer(
        redis_client,
        f"{prefix}:rollouts",
        "reward",
        consumer_name,
        dead_stream=f"{prefix}:dead",
        min_idle_ms=min_idle_ms,
    )
    out = StreamProducer(redis_client, f"{prefix}:train")
    return RewardWorker(consumer, out, scorer, block_ms=20, **kw)


def _out(redis_client, prefix):
    return [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:train")]


async def _until(predicate, worker, timeout_s=60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await worker.step()


def test_slow_judge_does_not_block_the_stream(redis_client, prefix, fake_judge):
    fake_judge.hang_s = 3.0
    client = AsyncJudgeClient(
        fake_judge.url, "m", timeout_s=10, max_attempts=1, metrics=judge_metrics("reward")
    )
    scorer = Scorer("last_integer", judge=NextStateJudge(client, "prm_v2", votes=1))
    src = StreamProducer(redis_client, f"{prefix}:rollouts")
    src.publish(_turn("8 HANG", "slow"))
    for i in range(4):
        src.publish(_turn("8", f"fast{i}"))
    worker = _stage(redis_client, prefix, scorer, max_in_flight=8)

    async def scenario():
        def pending():
            return redis_client.xpending(f"{prefix}:rollouts", "reward")["pending"]

        await _until(lambda: len(_out(redis_client, prefix)) >= 4 and pending() == 1, worker)
        fast_done = [s.sample_id for s in _out(redis_client, prefix)]
        await _until(lambda: len(_out(redis_client, prefix)) == 5, worker)
        return fast_done

    fast_done = asyncio.run(scenario())
    # the slow one did not block the others, each acked when done (1 left pending)
    assert sorted(fast_done) == [f"fast{i}" for i in range(4)]
    assert _out(redis_client, prefix)[-1].sample_id == "slow"
    assert redis_client.xpending(f"{prefix}:rollouts", "reward")["pending"] == 0


def test_a_judge_that_does_not_answer_is_reported_down():
    # nothing listens on the port: a connection error; the up gauge goes from 1 to 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = judge_metrics("reward")
    metrics.up.labels("judge").set(1)
    client = AsyncJudgeClient(f"http://127.0.0.1:{port}/v1", "m", timeout_s=2, metrics=metrics)

    async def call():
        try:
            await client.complete("hi")
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as caught:
        asyncio.run(call())
    assert caught.value.kind == "connection"
    assert metrics.up.labels("judge")._value.get() == 0


def test_500_and_garbage_are_forwarded_unjudged_with_reasons(redis_client, prefix, fake_judge):
    client = AsyncJudgeClient(
        fake_judge.url,
        "m",
        timeout_s=2,
        max_attempts=2,
        backoff_s=0.01,
        metrics=judge_metrics("reward"),
    )
    scorer = Scorer("last_integer", judge=NextStateJudge(client, "prm_v2", votes=3))
    src = StreamProducer(redis_client, f"{prefix}:rollouts")
    for sid in ("FAIL500", "GARBAGE", "good"):
        src.publish(_turn(f"8 {sid}", sid))
    worker = _stage(redis_client, prefix, scorer)

    async def scenario():
        await _until(lambda: len(_out(redis_client, prefix)) == 3, worker)

    asyncio.run(scenario())
    out = {s.sample_id: s for s in _out(redis_client, prefix)}
    assert out["good"].has_reward and out["good"].reward == 2.0  # verifier 1 + judge 1
    assert is_unjudged(out["FAIL500"])
    assert out["FAIL500"].error.startswith("unjudged: judge infra/server_error")
    assert is_unjudged(out["GARBAGE"])
    assert out["GARBAGE"].error.startswith("unjudged: judge parse/no_verdict")
    assert out["GARBAGE"].rewards["verifier"] == 1.0 and "judge" not in out["GARBAGE"].rewards
    assert fake_judge.count("FAIL500") == 6  # 3 votes x 2 tries
    assert redis_client.xpending(f"{prefix}:rollouts", "reward")["pending"] == 0


class Exploding(Scorer):
    async def score(self, sample):
        if sample.sample_id == "boom":
            raise RuntimeError("scorer bug")
        if sample.sample_id == "stuck":
            await asyncio.sleep(30)
        return await super().score(sample)


def test_poison_entry_is_retried_then_dead_lettered_after_n_failures(redis_client, prefix):
    src = StreamProducer(redis_client, f"{prefix}:rollouts")
    src.publish(_turn("8", "boom"))
    src.publish(_turn("8", "stuck"))
    src.publish(_turn("8", "good"))
    # a failed entry is reclaimed (retried) once idle for min_idle_ms = 150 ms
    worker = _stage(
        redis_client,
        prefix,
        Exploding("last_integer"),
        min_idle_ms=150,
        max_failures=2,
        sample_timeout_s=0.3,
    )

    async def scenario():
        await _until(lambda: redis_client.xlen(f"{prefix}:dead") == 2, worker)
        await worker.drain()

    asyncio.run(scenario())
    dead = {
        decode_sample(f[FIELD]).sample_id: f[b"error"].decode()
        for _, f in redis_client.xrange(f"{prefix}:dead")
    }
    assert dead["boom"].startswith("scoring failed 2 times: RuntimeError: scorer bug")
    assert dead["stuck"].startswith("scoring failed 2 times: scoring took over 0.3 s")
    assert [s.sample_id for s in _out(redis_client, prefix)] == ["good"]
    assert redis_client.xpending(f"{prefix}:rollouts", "reward")["pending"] == 0


def test_entries_of_a_dead_consumer_are_reclaimed(redis_client, prefix):
    src = StreamProducer(redis_client, f"{prefix}:rollouts")
    for i in range(3):
        src.publish(_turn("8", f"s{i}"))
    dead = StreamConsumer(
        redis_client, f"{prefix}:rollouts", "reward", "crashed", dead_stream=f"{prefix}:dead"
    )
    assert len(dead.read(count=3, block_ms=10)) == 3  # read, then "crashes" (no ack)
    worker = _stage(
        redis_client, prefix, Scorer("last_integer"), consumer_name="c2", min_idle_ms=50
    )

    async def scenario():
        await asyncio.sleep(0.1)
        await _until(lambda: len(_out(redis_client, prefix)) == 3, worker)

    asyncio.run(scenario())
    assert sorted(s.sample_id for s in _out(redis_client, prefix)) == ["s0", "s1", "s2"]
    assert all(s.has_reward and s.reward == 1.0 for s in _out(redis_client, prefix))
    assert redis_client.xpending(f"{prefix}:rollouts", "reward")["pending"] == 0


def test_in_flight_entries_are_not_reclaimed_by_a_second_replica(redis_client, prefix, fake_judge):
    fake_judge.hang_s = 2.0
    client = AsyncJudgeClient(
        fake_judge.url, "m", timeout_s=30, max_attempts=1, metrics=judge_metrics("reward")
    )
    scorer = Scorer("last_integer", judge=NextStateJudge(client, "prm_v2", votes=1))
    StreamProducer(redis_client, f"{prefix}:rollouts").publish(_turn("8 HANG", "slow"))
    first = _stage(redis_client, prefix, scorer, consumer_name="r1", min_idle_ms=600)
    second = _stage(redis_client, prefix, scorer, consumer_name="r2", min_idle_ms=600)

    async def scenario():
        await _until(lambda: first.tasks, first)
        deliveries = []
        end = asyncio.get_running_loop().time() + 1.6  # both replicas poll past the
        while asyncio.get_running_loop().time() < end:  # 600 ms idle limit
            await first.step()
            await second.step()
            deliveries += [
                r["times_delivered"]
                for r in redis_client.xpending_range(f"{prefix}:rollouts", "reward", "-", "+", 10)
            ]
        await first.drain()
        await second.drain()
        return deliveries

    deliveries = asyncio.run(scenario())
    assert fake_judge.count("HANG") == 1  # the lease kept r2 from re-scoring it
    assert deliveries and max(deliveries) == 1  # and r1's own reads from re-delivering it
    assert [s.sample_id for s in _out(redis_client, prefix)] == ["slow"]


def test_judge_down_opens_the_breaker_and_the_backlog_waits_in_the_stream(redis_client, prefix):
    import httpx  # noqa: PLC0415

    from flywheel.reward import metrics  # noqa: PLC0415

    state = {"down": True}

    def handler(request):
        if state["down"]:
            return httpx.Response(503)
        return httpx.Response(200, json={"choices": [{"message": {"content": "Final verdict: 1"}}]})

    client = AsyncJudgeClient(
        "http://judge/v1",
        "m",
        max_attempts=1,
        transport=httpx.MockTransport(handler),
        metrics=judge_metrics("reward"),
    )
    scorer = Scorer("last_integer", judge=NextStateJudge(client, "prm_v2", votes=1))
    src = StreamProducer(redis_client, f"{prefix}:rollouts")
    for i in range(6):
        src.publish(_turn("8", f"s{i}"))
    worker = _stage(
        redis_client, prefix, scorer, max_in_flight=1, breaker_samples=2, breaker_pause_s=2.0
    )

    async def scenario():
        loop = asyncio.get_running_loop()
        await _until(lambda: worker.breaker_open, worker)
        end = loop.time() + 0.5  # within the 2 s pause nothing more is read
        while loop.time() < end:
            await worker.step()
        forwarded_while_down = len(_out(redis_client, prefix))
        open_gauge = metrics.BREAKER_OPEN._value.get()
        state["down"] = False  # the judge comes back
        await _until(lambda: len(_out(redis_client, prefix)) == 6, worker)
        return forwarded_while_down, open_gauge

    forwarded_while_down, open_gauge = asyncio.run(scenario())
    out = _out(redis_client, prefix)
    assert forwarded_while_down == 2 and open_gauge == 1
    assert all(is_unjudged(s) for s in out[:2])
    assert all(s.has_reward and s.rewards["judge"] == 1.0 for s in out[2:])  # waited, judged
    assert not worker.breaker_open and metrics.BREAKER_OPEN._value.get() == 0
