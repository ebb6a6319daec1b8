"""The shared judge client reports under the caller's metric names: the teacher's hint judge
as `flywheel_teacher_judge_*`, the reward service's judges as `flywheel_reward_judge_*`."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import REGISTRY

from flywheel.core.judge_client import AsyncJudgeClient, JudgeClient, Parsed, judge_metrics


def _reply(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"content": "Final verdict: 1"}}]})


def _flaky() -> httpx.MockTransport:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503) if len(calls) == 1 else _reply(request)

    return httpx.MockTransport(handler)


def test_the_hint_judge_reports_as_the_teacher():
    client = JudgeClient(
        "http://judge/v1",
        "m",
        metrics=judge_metrics("teacher"),
        name="hint-test",
        backoff_s=0,
        transport=_flaky(),
    )
    assert client.complete("p") == "Final verdict: 1"
    labels = {"judge": "hint-test"}
    assert REGISTRY.get_sample_value("flywheel_teacher_judge_up", labels) == 1
    assert REGISTRY.get_sample_value("flywheel_teacher_judge_call_seconds_count", labels) == 2
    retried = {"judge": "hint-test", "reason": "server_error"}
    assert REGISTRY.get_sample_value("flywheel_teacher_judge_retries_total", retried) == 1
    assert REGISTRY.get_sample_value("flywheel_reward_judge_up", labels) is None


def test_a_reward_judge_reports_as_the_reward_service():
    client = AsyncJudgeClient(
        "http://judge/v1",
        "m",
        metrics=judge_metrics("reward"),
        name="judge-test",
        backoff_s=0,
        transport=_flaky(),
    )
    vote = asyncio.run(client.vote("p", lambda text: Parsed(1.0, "ok")))
    assert vote.value == 1.0 and vote.attempts == 2
    labels = {"judge": "judge-test"}
    assert REGISTRY.get_sample_value("flywheel_reward_judge_up", labels) == 1
    assert REGISTRY.get_sample_value("flywheel_teacher_judge_up", labels) is None


def test_metrics_of_one_service_are_registered_once():
    assert judge_metrics("teacher") is judge_metrics("teacher")
