"""Stream delivery on a real Redis: ack, redelivery after a crash, dead letter, backpressure."""

import pytest
from prometheus_client import REGISTRY

from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.errors import BackpressureError
from flywheel.core.streams import FIELD, StreamConsumer, StreamProducer


def _sample(i: int):
    return new_sample(
        token_ids=[i, i + 1],
        loss_mask=[0, 1],
        rollout_logprobs=[0.0, -0.1],
        weight_versions=[-1, 0],
        group_id=f"g{i}",
    )


def _consumer(client, prefix, name, **kw):
    kw.setdefault("min_idle_ms", 0)
    return StreamConsumer(client, f"{prefix}:s", "grp", name, dead_stream=f"{prefix}:dead", **kw)


def test_read_ack_and_no_redelivery_after_ack(redis_client, prefix):
    producer = StreamProducer(redis_client, f"{prefix}:s")
    consumer = _consumer(redis_client, prefix, "c1", min_idle_ms=60_000)
    ids = [producer.publish(_sample(i)) for i in range(3)]
    entries = consumer.read(count=10, block_ms=10)
    assert [e.entry_id for e in entries] == ids
    assert [e.sample.group_id for e in entries] == ["g0", "g1", "g2"]
    assert consumer.ack(ids) == 3
    assert consumer.read(count=10, block_ms=10) == []
    assert redis_client.xpending(f"{prefix}:s", "grp")["pending"] == 0


def test_crashed_consumer_entries_are_redelivered_to_another(redis_client, prefix):
    producer = StreamProducer(redis_client, f"{prefix}:s")
    crashed = _consumer(redis_client, prefix, "crashed")
    ids = [producer.publish(_sample(i)) for i in range(5)]
    assert len(crashed.read(count=5, block_ms=10)) == 5  # read, then "crash" without ack
    survivor = _consumer(redis_client, prefix, "survivor")
    # count 2 < 5 pending: the reclaimer must page with the XAUTOCLAIM cursor (BUG-24).
    got = []
    for _ in range(5):
        batch = survivor.read(count=2, block_ms=10)
        got += [e.entry_id for e in batch]
        survivor.ack([e.entry_id for e in batch])
    assert sorted(got) == sorted(ids)
    assert redis_client.xpending(f"{prefix}:s", "grp")["pending"] == 0


def test_entry_deleted_while_pending_is_counted_lost_not_returned(redis_client, prefix):
    producer = StreamProducer(redis_client, f"{prefix}:s")
    crashed = _consumer(redis_client, prefix, "crashed")
    ids = [producer.publish(_sample(i)) for i in range(5)]
    crashed.read(count=5, block_ms=10)
    redis_client.xdel(f"{prefix}:s", ids[2])
    survivor = _consumer(redis_client, prefix, "survivor")
    got = [e.entry_id for e in survivor.read(count=10, block_ms=10)]
    assert sorted(got) == sorted(ids[:2] + ids[3:])


def test_poison_entry_goes_to_dead_letter_with_error(redis_client, prefix):
    redis_client.xadd(f"{prefix}:s", {FIELD: b"\xffgarbage"})
    producer = StreamProducer(redis_client, f"{prefix}:s")
    good = producer.publish(_sample(7))
    consumer = _consumer(redis_client, prefix, "c1")
    entries = consumer.read(count=10, block_ms=10)
    assert [e.entry_id for e in entries] == [good]
    dead = redis_client.xrange(f"{prefix}:dead")
    assert len(dead) == 1 and b"undecodable" in dead[0][1][b"error"]
    assert dead[0][1][FIELD] == b"\xffgarbage"


def test_too_many_deliveries_dead_letters(redis_client, prefix):
    producer = StreamProducer(redis_client, f"{prefix}:s")
    entry = producer.publish(_sample(1))
    consumer = _consumer(redis_client, prefix, "c1", max_deliveries=2)
    assert len(consumer.read(count=1, block_ms=10)) == 1  # delivery 1
    assert len(consumer.read(count=1, block_ms=10)) == 1  # reclaimed: delivery 2
    assert consumer.read(count=1, block_ms=10) == []  # delivery 3 > 2: dead-lettered
    dead = redis_client.xrange(f"{prefix}:dead")
    assert dead[0][1][b"source_id"].decode() == entry
    assert decode_sample(dead[0][1][FIELD]).group_id == "g1"


def test_backpressure_at_high_water_and_nothing_trimmed(redis_client, prefix):
    producer = StreamProducer(redis_client, f"{prefix}:s", high_water=3, watch_group="grp")
    consumer = _consumer(redis_client, prefix, "c1", min_idle_ms=60_000)
    for i in range(3):
        producer.publish(_sample(i))
    with pytest.raises(BackpressureError):
        producer.publish(_sample(3))
    assert redis_client.xlen(f"{prefix}:s") == 3  # nothing evicted (BUG-26)
    entries = consumer.read(count=2, block_ms=10)
    consumer.ack([e.entry_id for e in entries])
    producer.publish(_sample(4))  # backlog fell to 1 below the mark
    assert redis_client.xlen(f"{prefix}:s") == 4


def test_async_backlog_agrees_with_the_sync_one(redis_client, prefix):
    import asyncio  # noqa: PLC0415

    stream = f"{prefix}:s"
    watched = StreamProducer(redis_client, stream, high_water=3, watch_group="grp")
    unwatched = StreamProducer(redis_client, stream)

    async def both(producer: StreamProducer) -> tuple[int, int]:
        return producer.backlog(), await producer.abacklog()

    for i in range(2):
        unwatched.publish(_sample(i))
    # no group yet: the whole stream (2 entries) is the backlog of the watched group
    assert asyncio.run(both(watched)) == (2, 2)
    assert asyncio.run(both(unwatched)) == (0, 0)  # nothing watched: never backpressure
    consumer = _consumer(redis_client, prefix, "c1", min_idle_ms=60_000)
    consumer.read(count=1, block_ms=10)  # 1 delivered, pending; 1 not yet delivered (lag)
    unwatched.publish(_sample(2))
    assert asyncio.run(both(watched)) == (3, 3)  # lag 2 + pending 1


def test_a_consumer_group_gone_from_redis_is_created_again(redis_client, prefix):
    """Redis back without its data (here: the group destroyed, as after a restart without
    persistence): the next read recreates the group at the start of the stream, counts it, and
    the consumer goes on reading what is published from then on."""
    stream = f"{prefix}:rollouts"
    consumer = StreamConsumer(redis_client, stream, "reward", "c1", dead_stream=f"{prefix}:dead")
    redis_client.delete(stream)  # the stream and its group are gone
    labels = {"stream": stream, "group": "reward"}
    assert REGISTRY.get_sample_value("flywheel_stream_group_recreated_total", labels) is None
    assert consumer.read(count=4, block_ms=10) == []
    assert REGISTRY.get_sample_value("flywheel_stream_group_recreated_total", labels) == 1.0
    entry_id = StreamProducer(redis_client, stream).publish(new_sample(group_id="after"))
    assert [e.entry_id for e in consumer.read(count=4, block_ms=10)] == [entry_id]


def test_an_entry_without_a_sample_field_is_dead_lettered_saying_so(redis_client, prefix):
    consumer = _consumer(redis_client, prefix, "c1")
    redis_client.xadd(f"{prefix}:s", {"payload": b"x"})
    assert consumer.read(count=4, block_ms=10) == []
    (entry,) = redis_client.xrange(f"{prefix}:dead")
    assert entry[1][b"error"] == b"entry has no 'sample' field (fields: ['payload'])"
