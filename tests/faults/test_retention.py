"""Retention against a real Redis: only entries every consumer group has acked and that are
older than the retention are trimmed; a pending entry, an entry a group has not read yet, a
young entry and a stream without groups all survive; the count is kept for `flywheel status`."""

from __future__ import annotations

from flywheel.core.retention import oldest_age_s, trim_stream, trimmed_counts


def _ids(client, stream) -> list[str]:
    return [e.decode() for e, _ in client.xrange(stream)]


def test_trims_only_entries_consumed_by_every_group(redis_client, prefix):
    stream = f"{prefix}:rollouts"
    old = [f"{1000 + i}-0" for i in range(6)]  # ids from 1970: far older than an hour
    for entry_id in old:
        redis_client.xadd(stream, {"s": b"x"}, id=entry_id)
    redis_client.xgroup_create(stream, "reward", id="0")
    redis_client.xgroup_create(stream, "audit", id="0")
    redis_client.xreadgroup("reward", "r1", {stream: ">"}, count=6)
    redis_client.xack(stream, "reward", *[i for i in old if i != old[2]])  # old[2] pending
    redis_client.xreadgroup("audit", "a1", {stream: ">"}, count=5)  # old[5] not read by audit
    redis_client.xack(stream, "audit", *old[:5])

    # point = min(age cut, reward's pending old[2], audit's after old[4]) = old[2]
    assert trim_stream(redis_client, stream, 3600, prefix) == 2
    assert _ids(redis_client, stream) == old[2:]

    redis_client.xack(stream, "reward", old[2])  # now reward is done with all six
    # point = min(age cut, reward after old[5], audit after old[4]) = 1004-1: old[2..4] go
    assert trim_stream(redis_client, stream, 3600, prefix) == 3
    assert _ids(redis_client, stream) == old[5:]  # audit has not read it: kept

    fresh = redis_client.xadd(stream, {"s": b"y"}).decode()  # now: younger than the retention
    redis_client.xreadgroup("reward", "r1", {stream: ">"})
    redis_client.xreadgroup("audit", "a1", {stream: ">"})
    redis_client.xack(stream, "reward", old[5], fresh)
    redis_client.xack(stream, "audit", old[5], fresh)
    assert trim_stream(redis_client, stream, 3600, prefix) == 1  # old[5] only
    assert _ids(redis_client, stream) == [fresh]
    assert trim_stream(redis_client, stream, 3600, prefix) == 0
    age = oldest_age_s(redis_client, stream)
    assert age is not None and 0 <= age < 60
    assert trimmed_counts(redis_client, prefix) == {stream: 6}


def test_stream_without_groups_is_kept(redis_client, prefix):
    dead = f"{prefix}:dead"
    redis_client.xadd(dead, {"s": b"x"}, id="1000-0")
    assert trim_stream(redis_client, dead, 1, prefix) == 0
    assert redis_client.xlen(dead) == 1
    assert trim_stream(redis_client, f"{prefix}:missing", 1, prefix) == 0
    assert oldest_age_s(redis_client, dead) > 1e9  # 1970: about 56 years in seconds


def test_status_shows_what_is_kept(redis_server, redis_client, prefix):
    from rich.console import Console  # noqa: PLC0415

    from flywheel.core.settings import FlywheelSettings  # noqa: PLC0415
    from flywheel.ops.status import collect_status, render  # noqa: PLC0415

    train = f"{prefix}:train"
    for i in range(3):
        redis_client.xadd(train, {"s": b"x"}, id=f"{1000 + i}-0")
    redis_client.xgroup_create(train, "trainer", id="0")
    redis_client.xreadgroup("trainer", "t1", {train: ">"}, count=2)
    redis_client.xack(train, "trainer", "1000-0", "1001-0")
    assert trim_stream(redis_client, train, 60, prefix) == 2

    settings = FlywheelSettings(
        redis={"url": redis_server.url}, streams={"prefix": prefix, "retention": "12h"}
    )
    report = collect_status(settings)
    stats = {s.name: s for s in report.streams}
    assert stats["train"].length == 1 and stats["train"].trimmed == 2
    assert stats["train"].oldest_age_s > 1e9  # the kept entry's id is from 1970
    assert stats["rollouts"].trimmed == 0 and stats["rollouts"].oldest_age_s is None
    assert report.to_json()["retention"] == {
        "streams": "12h",
        "session_ttl_s": settings.gateway.session_ttl_s,
    }
    console = Console(width=200, record=True)
    console.print(render(report))
    text = console.export_text()
    assert "older than 12h are trimmed" in text
    assert f"{prefix}:train" in text


def test_gateway_process_runs_the_retention(
    procs, redis_server, redis_client, prefix, tiny_model_dir
):
    """A gateway process with `streams.retention = "1s"` trims the consumed entries of the
    pipeline's streams on its own, and keeps the pending one."""
    import time  # noqa: PLC0415

    rollouts = f"{prefix}:rollouts"
    for i in range(4):
        redis_client.xadd(rollouts, {"s": b"x"}, id=f"{1000 + i}-0")
    redis_client.xgroup_create(rollouts, "reward", id="0")
    redis_client.xreadgroup("reward", "r1", {rollouts: ">"}, count=4)
    redis_client.xack(rollouts, "reward", "1000-0", "1001-0", "1003-0")  # 1002-0 pending
    procs.gateway(
        redis_server.url,
        prefix,
        [procs.stub("ok")],
        tiny_model_dir,
        streams={"retention": "1s", "retention_check_s": 0.2},
    )
    deadline = time.monotonic() + 30
    while _ids(redis_client, rollouts)[0] != "1002-0":
        assert time.monotonic() < deadline, _ids(redis_client, rollouts)
        time.sleep(0.1)
    assert _ids(redis_client, rollouts) == ["1002-0", "1003-0"]  # the pending one stays
    assert trimmed_counts(redis_client, prefix) == {rollouts: 2}
