"""The reward service as a real process (`python -m flywheel.reward`): gRPC Score/ScoreBatch
with status details, health, reflection, the stream path and /metrics, with a fake
OpenAI-compatible judge over real HTTP and a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from flywheel._proto import reward_pb2, reward_pb2_grpc
from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD, StreamProducer
from flywheel.reward.fake_judge import FakeJudge

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def service(tmp_path_factory, redis_server):
    judge = FakeJudge()
    state = tmp_path_factory.mktemp("reward")
    port, metrics_port = free_port(50261), free_port(9261)
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": "rgrpc", "block_ms": 100},
        reward={
            "port": port,
            "metrics_port": metrics_port,
            "default_verifier": "last_integer",
            "weights": {"judge": 0.5},
            "judge": {
                "enabled": True,
                "base_url": judge.url,
                "model": "fake",
                "votes": 3,
                "max_attempts": 2,
                "backoff_s": 0.01,
                "timeout_s": 5,
            },
        },
        state_dir=str(state),
    )
    config = state / "settings.json"
    config.write_text(json.dumps(settings.model_dump(mode="json")))
    log = open(state / "reward.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.reward"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "FLYWHEEL_CONFIG": str(config)},
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        yield channel, settings, judge, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=20)
        judge.close()
        log.close()


def _turn(reply, sample_id, answer=8):
    s = new_sample(task_json=json.dumps({"answer": answer}), sample_id=sample_id)
    s.messages.add(role="user", content_json=json.dumps("What is 7 + 1?"))
    s.messages.add(role="assistant", content_json=json.dumps(reply))
    s.next_state.role = "user"
    s.next_state.content_json = json.dumps("thanks!")
    return s


def test_health_and_reflection(service):
    channel = service[0]
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "flywheel.v1.RewardService"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(
        refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"flywheel.v1.RewardService", "grpc.health.v1.Health"} <= names


def test_score_and_score_batch(service):
    channel = service[0]
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    resp = stub.Score(reward_pb2.ScoreRequest(sample=_turn("8", "one")), timeout=30)
    # verifier 1.0 (last integer 8) + 0.5 * judge (+1, three valid votes) = 1.5
    assert resp.has_reward and resp.reward == pytest.approx(1.5) and resp.sample_id == "one"
    assert dict(resp.rewards) == {"verifier": 1.0, "judge": 1.0}
    assert [v.judge for v in resp.votes] == ["judge:prm@v2"] * 3

    batch = stub.ScoreBatch(
        reward_pb2.ScoreBatchRequest(
            samples=[_turn("8", "a"), _turn("FAIL500: 8", "b"), _turn("9 GARBAGE", "c")]
        ),
        timeout=60,
    )
    by_id = [r.sample_id for r in batch.responses]
    assert by_id == ["a", "b", "c"]
    a, b, c = batch.responses
    assert a.has_reward and a.reward == pytest.approx(1.5)
    assert not b.has_reward and b.error.startswith("unjudged: judge infra/server_error")
    assert b.rewards["verifier"] == 1.0 and b.reward == pytest.approx(1.0)
    assert not c.has_reward and c.error.startswith("unjudged: judge parse/no_verdict")
    assert c.rewards["verifier"] == 0.0


def test_bad_requests_are_invalid_argument_with_details(service):
    stub = reward_pb2_grpc.RewardServiceStub(service[0])
    bad = _turn("8", "bad")
    bad.token_ids.extend([1, 2, 3])  # loss_mask etc. stay empty
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(reward_pb2.ScoreRequest(sample=bad), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(info.value)
    detail = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(detail)
    assert detail.field_violations[0].field == "sample"

    with pytest.raises(grpc.RpcError) as info:
        stub.ScoreBatch(reward_pb2.ScoreBatchRequest(samples=[_turn("8", "ok"), bad]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(info.value)
    status.details[0].Unpack(detail)
    assert [v.field for v in detail.field_violations] == ["samples[1]"]

    with pytest.raises(grpc.RpcError) as info:
        stub.ScoreBatch(reward_pb2.ScoreBatchRequest(samples=[]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "split the batch" in info.value.details() or "1 to" in info.value.details()


def test_deadline_is_deadline_exceeded(service):
    stub = reward_pb2_grpc.RewardServiceStub(service[0])
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(reward_pb2.ScoreRequest(sample=_turn("8 HANG", "slow")), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_stream_path_and_metrics(service):
    _channel, settings, _judge, metrics_url = service
    client = connect(settings.redis_url())
    src = StreamProducer(client, settings.streams.key("rollouts"))
    src.publish(_turn("8", "streamed"))
    src.publish(_turn("FAIL500: 8", "streamed-down"))
    deadline = time.monotonic() + 60
    out = {}
    while len(out) < 2 and time.monotonic() < deadline:
        out = {
            decode_sample(f[FIELD]).sample_id: decode_sample(f[FIELD])
            for _, f in client.xrange(settings.streams.key("train"))
        }
        time.sleep(0.2)
    assert out["streamed"].has_reward and out["streamed"].reward == pytest.approx(1.5)
    assert out["streamed-down"].error.startswith("unjudged: judge infra/server_error")
    text = httpx.get(metrics_url, timeout=5).text
    lines = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(lines['flywheel_reward_judged_total{judge="judge"}']) >= 2
    assert float(lines['flywheel_reward_unjudged_total{judge="judge",reason="server_error"}']) >= 1
    assert float(lines['flywheel_reward_judge_call_seconds_count{judge="judge"}']) >= 6
    assert float(lines['flywheel_reward_component_value_count{component="verifier"}']) >= 2
    assert float(lines['flywheel_reward_samples_total{outcome="unjudged"}']) >= 1
    assert float(lines['flywheel_reward_vote_agreement_ratio_count{judge="judge"}']) >= 1
    assert lines['flywheel_reward_judge_up{judge="judge"}'] in ("0.0", "1.0")
