"""The trainer against bad Samples and a Redis outage, with a real Redis, the tiny model and a
fake engine: a Sample it cannot train (a token id outside the vocabulary, a NaN reward) is
dead-lettered at admission while its neighbours train; an entry that stopped the trainer on
every try is dead-lettered after `max_deliveries`; a Redis restart is waited out."""

from __future__ import annotations

import math
import threading
import time

import pytest
from prometheus_client import REGISTRY

from flywheel.core.codec import new_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import LocalRedis
from flywheel.core.streams import StreamConsumer, StreamProducer
from flywheel.trainer.service import build_trainer
from flywheel.trainer.sources import CONSUMER_GROUP, RedisSource

from .test_trainer_service import (
    VOCAB,
    engine,  # noqa: F401 (fixture)
    make_group,
    model_dir,  # noqa: F401 (fixture)
    pending_count,
    publish,
    run_steps,
    trainer_settings,
)

pytestmark = pytest.mark.integration


def _bad(group_id: str, token_id: int = 5, reward: float = 1.0):
    return new_sample(
        token_ids=[1, 2, token_id, 3],
        loss_mask=[0, 0, 1, 1],
        rollout_logprobs=[0.0, 0.0, -1.0, -1.0],
        weight_versions=[-1, -1, 0, 0],
        group_id=group_id,
        reward=reward,
        has_reward=True,
    )


def test_untrainable_samples_are_dead_lettered_and_their_neighbours_trained(
    tmp_path, redis_server, prefix, engine, model_dir
):  # noqa: F811
    settings = trainer_settings(tmp_path, redis_server, prefix, engine.url, model_dir=model_dir)
    trainer = build_trainer(settings)
    publish(
        settings,
        [
            _bad("oov", token_id=VOCAB),
            _bad("neg", token_id=-7),
            _bad("nan", reward=math.nan),
            *make_group(model_dir, "g1"),
        ],
    )
    assert run_steps(trainer) == 1  # the clean group trained; nothing crashed
    dead = connect(settings.redis_url()).xrange(settings.streams.key("dead"))
    errors = sorted(fields[b"error"].decode() for _, fields in dead)
    assert len(errors) == 3 and all(e.startswith("invalid: ") for e in errors), errors
    assert sum(f"token id {VOCAB} is outside" in e for e in errors) == 1
    assert sum("token id -7 is outside" in e for e in errors) == 1
    assert sum("reward is nan" in e for e in errors) == 1
    assert pending_count(settings) == 0
    trainer.close()


def test_an_entry_taken_back_too_often_after_restarts_is_dead_lettered(redis_client, prefix):
    """A stable consumer name takes its own pending entries back at start; an entry that
    crashed it each time (3 deliveries > max_deliveries 2) goes to the dead-letter stream."""
    stream, dead = f"{prefix}:train", f"{prefix}:dead"
    StreamProducer(redis_client, stream).publish(_bad("g"))

    def restart() -> list:
        consumer = StreamConsumer(
            redis_client, stream, CONSUMER_GROUP, "trainer-0", dead_stream=dead, max_deliveries=2
        )
        return RedisSource(consumer).read(count=4, block_ms=10)

    assert len(restart()) == 1  # delivery 1: the trainer dies before acking
    assert len(restart()) == 1  # delivery 2: taken back, dies again
    assert restart() == []  # delivery 3: dead-lettered instead
    (entry,) = redis_client.xrange(dead)
    assert entry[1][b"error"] == b"delivered 3 times without an ack"
    assert redis_client.xpending(stream, CONSUMER_GROUP)["pending"] == 0


def test_a_redis_restart_is_waited_out(tmp_path, prefix, engine, model_dir):  # noqa: F811
    server = LocalRedis(tmp_path / "redis").start()
    try:
        settings = trainer_settings(tmp_path, server, prefix, engine.url, model_dir=model_dir)
        trainer = build_trainer(settings)
        errors = REGISTRY.get_sample_value("flywheel_trainer_redis_errors_total") or 0.0
        steps: list[int] = []
        runner = threading.Thread(target=lambda: steps.append(run_steps(trainer, 1, 120)))
        runner.start()
        time.sleep(0.5)  # the trainer is blocked reading the empty stream
        server.proc.kill()
        server.proc.wait()
        time.sleep(2.0)  # reads fail meanwhile: retried with backoff, not fatal
        server.start()
        publish(settings, make_group(model_dir, "g1"))
        runner.join(timeout=150)
        assert steps == [1]
        assert REGISTRY.get_sample_value("flywheel_trainer_redis_errors_total") > errors
        assert pending_count(settings) == 0
        trainer.close()
    finally:
        server.stop()
