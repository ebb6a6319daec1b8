"""A whole local stack on the tiny model that has trained one step, for the operator's views
(`flywheel status`, the gateway's /dashboard).

Real Redis, engine, gateway, reward and trainer processes (flywheel.ops.stack.Stack). Three groups
of two episodes go through the gateway with outcome rewards 0 and 1 (so the group has a reward
spread); the reward service scores them, the trainer takes one GRPO step per group, checkpoints
each and pushes it to the engine (weight version 3 at the end). Use it from a test module with
`from .ops_stack import ops_stack  # noqa: F401`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from flywheel.core.settings import FlywheelSettings, load_settings
from flywheel.ops.stack import Stack

GROUP_SIZE = 2
STEPS = 3
"""Groups sent = trainer steps taken (one group per step), so the curves have 3 points."""


@dataclass
class OpsStack:
    settings: FlywheelSettings
    urls: dict[str, str]
    state_dir: Path
    metrics_path: Path


_RUNNING: list[OpsStack] = []
"""The stack, once started: each test module that imports the fixture gets its own (session)
fixture definition, and all of them share this one stack."""


def _episode(gateway: str, group: str, content: str, outcome: float) -> str:
    s = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group, "task": {"answer": 8}}).json()
    r = httpx.post(
        f"{s['base_url']}/chat/completions",
        timeout=120,
        json={
            "model": "SmolLM2-135M-Instruct",
            "max_tokens": 8,
            "temperature": 1.0,
            "messages": [{"role": "user", "content": content}],
        },
    )
    assert r.status_code == 200, r.text
    f = httpx.post(f"{gateway}/v1/sessions/{s['session_id']}/finish", json={"reward": outcome})
    assert f.status_code == 200, f.text
    return s["session_id"]


@pytest.fixture(scope="session")
def ops_stack(tmp_path_factory, redis_server, tiny_model_dir) -> Iterator[OpsStack]:
    if _RUNNING:
        yield _RUNNING[0]
        return
    state = tmp_path_factory.mktemp("ops_state")
    metrics_path = state / "trainer_metrics.jsonl"
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": "ops", "block_ms": 100},
        engine={
            "model_path": str(tiny_model_dir),
            "port": 31350,
            "batch_wait_ms": 5,
            "context_length": 512,
        },
        gateway={"port": 8850, "default_max_tokens": 8},
        reward={"port": 50181, "metrics_port": 9241},
        trainer={
            "port": 8950,
            "batch": {"groups_per_step": 1, "group_size": GROUP_SIZE, "group_wait_s": 5},
            "checkpoint": {"dir": str(state / "ckpt")},
            "logging": {"metrics_path": str(metrics_path)},
        },
        state_dir=str(state),
    )
    with Stack(settings, echo=lambda _: None) as running:
        urls = {s.name: s.url for s in running.services}
        for step in range(STEPS):
            for i in range(GROUP_SIZE):
                _episode(
                    urls["gateway"],
                    f"ops-g{step}",
                    f"What is 7 + {step}? ({i})",
                    outcome=float(i % 2),
                )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            status = httpx.get(f"{urls['trainer']}/status").json()
            if status["step"] >= STEPS:
                break
            time.sleep(0.5)
        assert status["step"] == STEPS, status
        assert json.loads(metrics_path.read_text().splitlines()[-1])["step"] == STEPS
        _RUNNING.append(OpsStack(settings, urls, state, metrics_path))
        try:
            yield _RUNNING[0]
        finally:
            _RUNNING.clear()
