"""`flywheel status` against a real running stack (tiny model, three committed trainer steps).

Checks what an operator reads off the screen: every service healthy, each stream's length and
each consumer group's lag and pending count (matching XINFO GROUPS arithmetic), the dead-letter
count, the weight version each engine serves, and the trainer's step and last reward; then a
service going down turns the screen (and the exit status) unhealthy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flywheel.core.redis_client import connect
from flywheel.core.stream_stats import StreamStatsCollector, stream_stats
from flywheel.ops.status import collect_status

from .ops_stack import GROUP_SIZE, STEPS, ops_stack  # noqa: F401  (session fixture)

pytestmark = pytest.mark.integration


def _cli_status(stack, *args: str) -> subprocess.CompletedProcess:
    config = stack.state_dir / "status-config.json"
    config.write_text(json.dumps({"state_dir": str(stack.state_dir), "streams": {"prefix": "ops"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    return subprocess.run(
        [sys.executable, "-m", "flywheel.ops.cli", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_status_json_reports_health_streams_versions_and_trainer(ops_stack):  # noqa: F811
    s = ops_stack
    client = connect(s.settings.redis_url())
    rollouts, dead = s.settings.streams.key("rollouts"), s.settings.streams.key("dead")
    # An extra group that has read nothing: its lag is the whole stream. One dead letter.
    client.xgroup_create(rollouts, "audit", id="0")
    client.xadd(dead, {"sample": b"x", "error": "test: poison sample"})
    try:
        run = _cli_status(s, "--json")
        assert run.returncode == 0, run.stdout + run.stderr
        report = json.loads(run.stdout)
        assert report["healthy"] is True
        assert {x["name"]: x["healthy"] for x in report["services"]} == {
            "engine": True,
            "gateway": True,
            "reward": True,
            "trainer": True,
        }
        assert report["redis"]["ok"] and "***" not in report["redis"]["url"]  # no password here
        streams = {x["name"]: x for x in report["streams"]}
        length = client.xlen(rollouts)
        assert streams["rollouts"]["length"] == length == STEPS * GROUP_SIZE  # episodes
        groups = {g["group"]: g for g in streams["rollouts"]["groups"]}
        # reward consumed and acked both; audit was created at 0 and read nothing.
        assert (groups["reward"]["lag"], groups["reward"]["pending"]) == (0, 0)
        assert (groups["audit"]["lag"], groups["audit"]["pending"]) == (length, 0)
        train_groups = {g["group"]: g for g in streams["train"]["groups"]}
        assert train_groups["trainer"]["lag"] == 0
        assert report["dead_letters"] == 1
        # The engine serves the last step's checkpoint (weight version 3), the trainer's: in
        # the fleet (configured: static), in service, at the fleet's version.
        assert report["source"] == "flywheel up"  # the stack running from this state dir
        assert report["engines"] == [
            {
                "url": s.urls["engine"],
                "source": "static",
                "state": "in_service",
                "weight_version": STEPS,
            }
        ]
        assert report["fleet_weight_version"] == STEPS
        trainer = report["trainer"]
        assert trainer["step"] == STEPS and trainer["weight_version"] == str(STEPS)
        last = json.loads(s.metrics_path.read_text().splitlines()[-1])
        assert trainer["last_metrics"]["reward/mean"] == pytest.approx(last["reward/mean"])

        screen = _cli_status(s)
        assert screen.returncode == 0
        for text in (
            "ops:rollouts",
            "audit",
            "dead letters: 1",
            f"trainer: step {STEPS}",
            f"weight version {STEPS}",
            s.urls["engine"],
        ):
            assert text in screen.stdout, (text, screen.stdout)
    finally:
        client.xgroup_destroy(rollouts, "audit")
        client.delete(dead)


def test_stream_gauges_match_the_status(ops_stack):  # noqa: F811
    s = ops_stack
    client = connect(s.settings.redis_url())
    stats = {st.name: st for st in stream_stats(client, s.settings.streams)}
    families = {f.name: f for f in StreamStatsCollector(client, s.settings.streams).collect()}
    samples = {
        (m.name, tuple(sorted(m.labels.items()))): m.value
        for f in families.values()
        for m in f.samples
    }
    assert samples[("flywheel_stream_length_entries", (("stream", "rollouts"),))] == (
        stats["rollouts"].length
    )
    reward = next(g for g in stats["rollouts"].groups if g.group == "reward")
    key = (("group", "reward"), ("stream", "rollouts"))
    assert samples[("flywheel_stream_lag_entries", key)] == reward.lag
    assert samples[("flywheel_stream_pending_entries", key)] == reward.pending


def test_a_service_that_stops_answering_shows_as_down(ops_stack):  # noqa: F811
    s = ops_stack
    state = json.loads((s.state_dir / "stack.json").read_text())
    state["trainer"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    report = collect_status(s.settings, state)
    assert not report.healthy and report.trainer is None
    down = [x.name for x in report.services if not x.healthy]
    assert down == ["trainer"]


def test_the_teacher_and_its_engine_are_probed_when_enabled():
    from flywheel.core.settings import load_settings  # noqa: PLC0415
    from flywheel.ops.status import service_targets  # noqa: PLC0415

    names = [n for n, _, _ in service_targets(load_settings())]
    assert names == ["engine", "gateway", "reward", "trainer"]
    targets = {n: t for n, _, t in service_targets(load_settings(teacher={"enabled": True}))}
    assert targets["teacher"] == "127.0.0.1:50052"
    assert targets["teacher-engine"] == "http://127.0.0.1:30100/health"
    state = {"teacher": "grpc://127.0.0.1:50999", "teacher-engine": "http://127.0.0.1:31999"}
    targets = {n: t for n, _, t in service_targets(load_settings(), state)}
    assert targets["teacher"] == "127.0.0.1:50999"
    assert targets["teacher-engine"] == "http://127.0.0.1:31999/health"
    self_teacher = load_settings(teacher={"enabled": True, "self_teacher": True})
    assert "teacher-engine" not in [n for n, _, _ in service_targets(self_teacher)]


def test_services_bound_to_every_interface_are_reached_by_service_name(monkeypatch):
    """In compose and Kubernetes every service binds 0.0.0.0 and is reached by its name."""
    from flywheel.core.settings import load_settings  # noqa: PLC0415
    from flywheel.ops.status import service_targets  # noqa: PLC0415

    s = load_settings(
        engine={"host": "0.0.0.0"},
        gateway={"host": "0.0.0.0"},
        reward={"host": "0.0.0.0"},
        trainer={"host": "0.0.0.0", "port": 8101},
    )
    targets = {n: t for n, _, t in service_targets(s)}
    assert targets == {
        "engine": "http://engine:30000/health",
        "gateway": "http://gateway:8000/readyz",
        "reward": "reward:50051",
        "trainer": "http://trainer:8101/readyz",
    }


def test_lag_counts_only_entries_that_still_exist(redis_client, prefix):
    """Lag after a deletion (redis/redis#13957: XINFO reports it wrong or unknown after XDEL or
    XTRIM): 5 entries, the group reads 2 (pending 2), entry 4 is deleted -> lag 2 (entries 3
    and 5), length 4. A group created at `$` afterwards has lag 0."""
    from flywheel.core.settings import StreamSettings  # noqa: PLC0415

    streams = StreamSettings(prefix=prefix)
    key = streams.key("rollouts")
    ids = [redis_client.xadd(key, {"t": str(i)}) for i in range(1, 6)]
    redis_client.xgroup_create(key, "reward", id="0")
    redis_client.xreadgroup("reward", "c1", {key: ">"}, count=2)
    redis_client.xdel(key, ids[3])
    redis_client.xgroup_create(key, "late", id="$")
    (rollouts,) = [s for s in stream_stats(redis_client, streams) if s.name == "rollouts"]
    groups = {g.group: g for g in rollouts.groups}
    assert rollouts.length == 4
    assert (groups["reward"].lag, groups["reward"].pending) == (2, 2)
    assert (groups["late"].lag, groups["late"].pending) == (0, 0)


def test_without_a_stack_here_reads_are_labelled_and_changes_refused(ops_stack, tmp_path):  # noqa: F811
    """A folder with no `flywheel up` running, whose default addresses reach another stack (the
    ops stack, its ports given as plain settings as a second user's defaults would be): status
    and the lists say which deployment they read; keys and engines changes are refused and
    change nothing until the deployment is named (FLYWHEEL_REDIS__URL)."""
    s = ops_stack
    client = connect(s.settings.redis_url())
    port = s.settings.redis_url().rsplit(":", 1)[1].split("/")[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env |= {
        "FLYWHEEL_REDIS__PORT": port,
        "FLYWHEEL_STREAMS__PREFIX": "ops",
        "FLYWHEEL_ENGINE__PORT": "31350",
        "FLYWHEEL_GATEWAY__PORT": "8850",
        "FLYWHEEL_REWARD__PORT": "50181",
        "FLYWHEEL_TRAINER__PORT": "8950",
    }

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "flywheel.ops.cli", *args],
            capture_output=True,
            text=True,
            env=env | extra,
            cwd=tmp_path,  # no .flywheel here: no stack of this folder's
            timeout=60,
        )

    status = cli("status", "--json")
    assert "no `flywheel up` is running from .flywheel" in status.stderr, status.stderr
    assert f"Redis redis://127.0.0.1:{port}/0), which may be another stack's" in status.stderr
    assert json.loads(status.stdout)["source"] == "configured addresses"
    listing = cli("engines", "list")
    assert listing.returncode == 0 and "which may be another stack's" in listing.stderr
    assert "serves 3" in listing.stdout  # the other stack's engine, as status shows it

    keys = client.keys("ops:apikey*")
    fleet = client.hgetall("ops:fleet:engines")
    for args in (
        ("keys", "create", "--role", "admin"),
        ("engines", "add", "http://127.0.0.1:9"),
        ("engines", "remove", s.urls["engine"]),
    ):
        refused = cli(*args)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "no `flywheel up` is running from .flywheel, so this would" in refused.stderr
        assert "pass --config FILE, or set FLYWHEEL_REDIS__URL=" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert client.keys("ops:apikey*") == keys and client.hgetall("ops:fleet:engines") == fleet

    # Named explicitly, the same change is made (and undone).
    named = cli("engines", "add", "http://127.0.0.1:9/", FLYWHEEL_REDIS__URL=s.settings.redis_url())
    assert named.returncode == 0, named.stderr
    assert "added http://127.0.0.1:9, but it does not answer" in named.stdout
    try:
        assert client.hget("ops:fleet:engines", "http://127.0.0.1:9") == b"admin"
    finally:
        client.hdel("ops:fleet:engines", "http://127.0.0.1:9")
