"""Field failures BUG-24 and BUG-26 on a real Redis, with their exact minimal inputs.

(Paging by the XAUTOCLAIM cursor with COUNT < pending and plain backpressure are also covered in
tests/unit/core/test_streams.py; these add the counted loss, the pending variant and the
"nothing evicted under load" check.)
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from flywheel.core.codec import new_sample
from flywheel.core.errors import BackpressureError
from flywheel.core.streams import StreamConsumer, StreamProducer


def _sample(i: int):
    return new_sample(
        token_ids=[i, i + 1],
        loss_mask=[0, 1],
        rollout_logprobs=[0.0, -0.1],
        weight_versions=[-1, 0],
        group_id=f"t{i}",
    )


def _consumer(client, stream, name, **kw):
    kw.setdefault("min_idle_ms", 0)
    return StreamConsumer(client, stream, "trainers", name, dead_stream=f"{stream}:dead", **kw)


def _lost(stream: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "flywheel_stream_lost_total", {"stream": stream, "group": "trainers"}
        )
        or 0.0
    )


def test_bug24_reclaim_pages_to_the_end_and_counts_the_deleted_entry(redis_client, prefix):
    stream = f"{prefix}:traj"
    producer = StreamProducer(redis_client, stream)
    c1 = _consumer(redis_client, stream, "c1")
    ids = [producer.publish(_sample(i)) for i in range(1, 6)]  # t1..t5
    assert len(c1.read(count=5, block_ms=10)) == 5  # c1 "crashes" without XACK
    redis_client.xdel(stream, ids[2])  # t3 deleted while pending
    before = _lost(stream)
    c2 = _consumer(redis_client, stream, "c2")
    owned = []
    for _ in range(4):  # COUNT 2 < 5 pending: only the cursor reaches the end
        batch = c2.reclaim(count=2)
        owned += [e.sample.group_id for e in batch]
        c2.ack([e.entry_id for e in batch])
    assert sorted(owned) == ["t1", "t2", "t4", "t5"]
    assert _lost(stream) - before == 1  # t3 reported lost and counted, not silently skipped
    assert redis_client.xpending(stream, "trainers")["pending"] == 0


def test_bug24_idle_entries_behind_many_busy_ones_are_reached_by_the_cursor(redis_client, prefix):
    """Redis scans at most COUNT x 10 pending entries per XAUTOCLAIM call: with 25 entries a live
    consumer is working on ahead of 3 a dead consumer left, one call from 0-0 with COUNT 2
    returns nothing; only following the cursor reaches the dead consumer's entries."""
    import time

    stream = f"{prefix}:traj"
    producer = StreamProducer(redis_client, stream)
    live, dead = (
        _consumer(redis_client, stream, name, min_idle_ms=60_000)  # read new only
        for name in ("live", "dead")
    )
    for i in range(28):
        producer.publish(_sample(i))
    busy = live.read(count=25, block_ms=10)
    assert len(busy) == 25 and len(dead.read(count=3, block_ms=10)) == 3
    time.sleep(0.2)
    # The live consumer touches its entries (idle time back to 0); the dead one's stay idle.
    redis_client.xclaim(stream, "trainers", "live", 0, [e.entry_id for e in busy], justid=True)
    one_call = redis_client.xautoclaim(stream, "trainers", "probe", 100, "0-0", count=2)
    assert one_call[1] == []  # what a reclaimer that drops the cursor would get
    reclaimer = _consumer(redis_client, stream, "c3", min_idle_ms=100)
    got = reclaimer.reclaim(count=2)
    assert [e.sample.group_id for e in got] == ["t25", "t26"]


def test_bug26_paused_trainer_blocks_the_producer_at_t3_nothing_evicted(redis_client, prefix):
    stream = f"{prefix}:traj"
    producer = StreamProducer(redis_client, stream, high_water=2, watch_group="trainers")
    trainer = _consumer(redis_client, stream, "c1")
    producer.publish(_sample(1))
    producer.publish(_sample(2))
    with pytest.raises(BackpressureError):  # t3: the producer blocks instead of trimming
        producer.publish(_sample(3))
    assert redis_client.xlen(stream) == 2
    got = [e.sample.group_id for e in trainer.read(count=10, block_ms=10)]
    assert got == ["t1", "t2"]  # the oldest entries are still there, in order


def test_bug26_pending_entries_count_against_the_mark(redis_client, prefix):
    stream = f"{prefix}:traj"
    producer = StreamProducer(redis_client, stream, high_water=2, watch_group="trainers")
    c1 = _consumer(redis_client, stream, "c1", min_idle_ms=60_000)
    producer.publish(_sample(1))
    producer.publish(_sample(2))
    read = c1.read(count=2, block_ms=10)  # read, not acked: still unconsumed
    with pytest.raises(BackpressureError):
        producer.publish(_sample(3))
    c1.ack([e.entry_id for e in read])
    for i in (3, 4):
        producer.publish(_sample(i))
    c2 = _consumer(redis_client, stream, "c2")
    assert [e.sample.group_id for e in c2.read(count=10, block_ms=10)] == ["t3", "t4"]


def test_no_trimming_under_sustained_publishing(redis_client, prefix):
    stream = f"{prefix}:traj"
    producer = StreamProducer(redis_client, stream, high_water=10_000, watch_group="trainers")
    _consumer(redis_client, stream, "idle")  # a group that never reads
    for i in range(500):
        producer.publish(_sample(i))
    assert redis_client.xlen(stream) == 500
    assert producer.backlog() == 500
