"""The end-to-end count identity under load with a crash, all services as real processes.

Stub engine, gateway, reward service and trainer (tiny model, `source = "redis"`) run as
processes on one real Redis. Four agents play two-turn episodes in groups of two; the reward
service is killed with SIGKILL while the load runs and started again. Once the pipeline drains:

    published (unique Samples in the rollouts stream, = the gateway's metric and the finish
    replies) == trained + dead-lettered + dropped with a metric (trainer drop reasons that do not
    dead-letter, other than `duplicate`)

and every copy the crashed reward service wrote twice is dropped by the trainer as `duplicate`
(one metric per copy), nothing stays pending in any consumer group.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import httpx

from flywheel.core.codec import decode_sample
from flywheel.core.redis_server import free_port
from flywheel.core.streams import FIELD
from flywheel.trainer.groups import DropReason

from .conftest import wait_http

AGENTS, EPISODES = 4, 8
CHAT = {"model": "m", "max_tokens": 8}


def _episode(http: httpx.Client, group: str, answer: int) -> int:
    """create -> 2 turns -> finish; returns the Samples the finish reports published."""
    sid = (
        http.post("/v1/sessions", json={"group_id": group, "task": {"answer": answer}})
        .raise_for_status()
        .json()["session_id"]
    )
    msgs = [{"role": "user", "content": "What is 7 + 1?"}]
    for _ in range(2):
        reply = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        reply.raise_for_status()
        msgs += [reply.json()["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
    return (
        http.post(f"/v1/sessions/{sid}/finish", json={})
        .raise_for_status()
        .json()["samples_published"]
    )


def _trainer(procs, tmp_path, redis_url: str, prefix: str, model_dir, engine: str) -> str:
    port = free_port()
    cfg = {
        "redis": {"url": redis_url},
        "streams": {"prefix": prefix, "block_ms": 100},
        "trainer": {
            "port": port,
            "model_path": str(model_dir),
            "push": {"engine_urls": [engine], "every": 1_000_000},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "keep": 1, "save_optimizer": False},
            "logging": {"metrics_path": str(tmp_path / "m.jsonl"), "tensorboard": False},
            "batch": {"group_size": 2, "groups_per_step": 2, "group_wait_s": 2.0},
            "optim": {"lr": 1e-4},
            "staleness": {"max_staleness": 1000},
        },
    }  # the stub engine takes no weights
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    procs.spawn(
        [sys.executable, "-m", "flywheel.trainer", "--config", str(path)], "trainer", env=env
    )
    return f"http://127.0.0.1:{port}"


def _metric(text: str, name: str) -> float:
    """Sum of every sample of Prometheus metric `name` (all label sets) in an exposition."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def test_counts_add_up_end_to_end_across_a_reward_crash(
    procs, tmp_path, redis_server, redis_client, prefix, tiny_model_dir
):
    rollouts, train, dead = (f"{prefix}:{s}" for s in ("rollouts", "train", "dead"))
    stub = procs.stub("ok")
    trainer = _trainer(procs, tmp_path, redis_server.url, prefix, tiny_model_dir, stub)
    # healthy before the next free port is picked, so no other service can take its port
    wait_http(f"{trainer}/healthz", 180)
    gateway = procs.gateway(redis_server.url, prefix, [stub], tiny_model_dir)
    streams = {"min_idle_ms": 500}  # the dead consumer's pending entries are reclaimed fast
    reward = procs.reward(redis_server.url, prefix, streams=streams)

    reported: list[int] = []
    errors: list[BaseException] = []

    def agent(i: int) -> None:
        # agents 2j and 2j+1 share each episode's group; their answers differ (8 is right, the
        # stub always says 8), so each group has rewards 1 and 0
        with httpx.Client(base_url=gateway, timeout=60) as http:
            try:
                for k in range(EPISODES):
                    reported.append(_episode(http, f"g{k}-{i // 2}", 8 + i % 2))
            except BaseException as exc:  # noqa: BLE001  (re-raised in the test thread)
                errors.append(exc)

    agents = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    for t in agents:
        t.start()
    deadline = time.monotonic() + 120
    while redis_client.xlen(rollouts) < AGENTS * EPISODES // 3:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.05)
    procs.kill(reward)  # SIGKILL mid-load: entries it held stay pending until reclaimed
    published_at_kill = redis_client.xlen(rollouts)
    procs.reward(redis_server.url, prefix, streams=streams)
    for t in agents:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in agents) and not errors, errors
    assert redis_client.xlen(rollouts) > published_at_kill  # the load went on after the kill

    def counts() -> dict:
        status = httpx.get(f"{trainer}/status", timeout=10).json()
        dropped = status["samples_dropped"]
        train_ids = [decode_sample(f[FIELD]).sample_id for _, f in redis_client.xrange(train)]
        return {
            "trained": status["samples_trained"],
            "dropped": dropped,
            "dead": redis_client.xlen(dead),
            "with_metric": sum(
                n
                for r, n in dropped.items()
                if r != DropReason.DUPLICATE and not DropReason(r).dead_letter
            ),
            "copies": len(train_ids) - len(set(train_ids)),
            "duplicates": dropped.get(DropReason.DUPLICATE, 0),
        }

    published = {decode_sample(f[FIELD]).sample_id for _, f in redis_client.xrange(rollouts)}
    assert len(published) == redis_client.xlen(rollouts) == sum(reported)  # none lost, none twice
    assert len(published) == AGENTS * EPISODES  # one Sample per episode
    deadline = time.monotonic() + 240
    while True:
        c = counts()
        accounted = c["trained"] + c["dead"] + c["with_metric"]
        if accounted == len(published) and c["duplicates"] == c["copies"]:
            break
        assert accounted <= len(published), c  # nothing counted twice
        assert time.monotonic() < deadline, (len(published), c)
        time.sleep(0.5)
    gateway_metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
    assert _metric(gateway_metrics, "flywheel_gateway_samples_published_total") == len(published)
    trainer_metrics = httpx.get(f"{trainer}/metrics", timeout=10).text
    assert _metric(trainer_metrics, "flywheel_trainer_samples_trained_total") == c["trained"]
    assert _metric(trainer_metrics, "flywheel_trainer_samples_dropped_total") == sum(
        c["dropped"].values()
    )
    assert c["trained"] > 0
    for stream, group in ((rollouts, "reward"), (train, "trainer")):
        deadline = time.monotonic() + 30
        while redis_client.xpending(stream, group)["pending"]:
            assert time.monotonic() < deadline, f"{stream} has entries pending in {group}"
            time.sleep(0.2)
