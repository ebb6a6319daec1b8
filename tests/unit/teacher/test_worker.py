"""The teacher stream stage on a real Redis: forward + ack, retry on outage, dead letter, and the
gRPC API (status codes, health, reflection) on a real server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from flywheel._proto import teacher_pb2, teacher_pb2_grpc
from flywheel.core.codec import decode_sample
from flywheel.core.errors import ContractError, UpstreamError
from flywheel.core.judge_client import judge_metrics
from flywheel.core.redis_server import free_port
from flywheel.core.streams import FIELD, StreamConsumer, StreamProducer
from flywheel.teacher.grpc_api import TeacherServicer, serve
from flywheel.teacher.pipeline import Teacher, TeacherConfig

from .teacher_fakes import FakeScorer, live_sample

HINT = {"hint": "The answer is 8."}


def _stage(redis_client, prefix, scorer, renderer):
    from flywheel.teacher.worker import TeacherWorker

    consumer = StreamConsumer(
        redis_client,
        f"{prefix}:scored",
        "teacher",
        "c1",
        dead_stream=f"{prefix}:dead",
        min_idle_ms=0,
        max_deliveries=2,
    )
    teacher = Teacher(scorer, renderer, TeacherConfig(model_name="teach"))
    return TeacherWorker(
        consumer,
        StreamProducer(redis_client, f"{prefix}:train"),
        teacher,
        block_ms=10,
        concurrency=4,
    )


def test_samples_flow_from_scored_to_train_and_are_acked(redis_client, prefix, renderer):
    inp = StreamProducer(redis_client, f"{prefix}:scored")
    for task in (HINT, {}, HINT):
        inp.publish(live_sample(renderer, task=task))
    worker = _stage(redis_client, prefix, FakeScorer(), renderer)
    assert worker.run_once() == 3
    out = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:train")]
    assert [s.teacher_status for s in out] == ["scored", "no_hint", "scored"]
    assert redis_client.xpending(f"{prefix}:scored", "teacher")["pending"] == 0


def test_outage_leaves_the_entry_pending_then_dead_letters_it(redis_client, prefix, renderer):
    StreamProducer(redis_client, f"{prefix}:scored").publish(live_sample(renderer, task=HINT))
    worker = _stage(redis_client, prefix, FakeScorer(fail=UpstreamError("down")), renderer)
    assert worker.run_once() == 0
    assert redis_client.xpending(f"{prefix}:scored", "teacher")["pending"] == 1
    assert worker.run_once() == 0  # delivery 2: still pending
    assert worker.run_once() == 0  # delivery 3 > max 2: dead-lettered
    dead = redis_client.xrange(f"{prefix}:dead")
    assert len(dead) == 1 and b"delivered 3 times" in dead[0][1][b"error"]
    assert redis_client.xlen(f"{prefix}:train") == 0


def test_poison_sample_is_dead_lettered_at_once(redis_client, prefix, renderer):
    StreamProducer(redis_client, f"{prefix}:scored").publish(live_sample(renderer, task=HINT))
    worker = _stage(redis_client, prefix, FakeScorer(fail=ContractError("misaligned")), renderer)
    assert worker.run_once() == 0
    dead = redis_client.xrange(f"{prefix}:dead")
    assert len(dead) == 1 and b"ContractError: misaligned" in dead[0][1][b"error"]
    assert redis_client.xpending(f"{prefix}:scored", "teacher")["pending"] == 0


@pytest.fixture
def grpc_target(renderer):
    teacher = Teacher(FakeScorer(), renderer, TeacherConfig(model_name="teach"))
    port = free_port(56000)
    server = serve(TeacherServicer(teacher, "fp-student", "fp-student"), "127.0.0.1", port)
    yield f"127.0.0.1:{port}", teacher
    server.stop(grace=0)


def _req(**kw):
    return teacher_pb2.ScoreTokensRequest(**kw)


def test_grpc_score_tokens_status_codes_health_and_reflection(grpc_target, renderer):
    target, teacher = grpc_target
    with grpc.insecure_channel(target) as channel:
        stub = teacher_pb2_grpc.TeacherServiceStub(channel)
        msgs = [{"role": "user", "content_json": '"What is 7 + 1?"'}]
        reply = stub.ScoreTokens(_req(messages=msgs, response_ids=[28, 2], hint="Say 8.", top_k=2))
        assert list(reply.logprobs) == pytest.approx([-0.1, -0.2])
        assert list(reply.topk_ids) == [10, 11, 10, 11] and reply.temperature == 1.0
        prompt_ids, response_ids, _ = teacher.scorer.calls[-1]
        assert response_ids == [28, 2] and reply.prompt_tokens == len(prompt_ids)
        assert "[Hindsight hint]\nSay 8." in renderer.tokenizer.decode(prompt_ids)
        reply = stub.ScoreTokens(_req(context_ids=[1, 2, 3], response_ids=[4]))
        assert teacher.scorer.calls[-1][0] == [1, 2, 3]
        for bad, code in [
            (_req(messages=msgs, response_ids=[]), grpc.StatusCode.INVALID_ARGUMENT),
            (_req(response_ids=[4]), grpc.StatusCode.INVALID_ARGUMENT),
            (
                _req(messages=msgs, response_ids=[4], vocab_fingerprint="fp-other"),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            (_req(messages=msgs, response_ids=[10**7]), grpc.StatusCode.FAILED_PRECONDITION),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.ScoreTokens(bad)
            assert err.value.code() == code
        with pytest.raises(grpc.RpcError) as err:
            stub.ExtractHint(teacher_pb2.ExtractHintRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # judge disabled
        scored = stub.ScoreSample(
            teacher_pb2.ScoreSampleRequest(sample=live_sample(renderer, task=HINT))
        ).sample
        assert scored.teacher_status == "scored" and sum(scored.teacher_mask) > 0
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="flywheel.v1.TeacherService")
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listing = next(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in listing.list_services_response.service}
        assert "flywheel.v1.TeacherService" in names


def test_grpc_extract_hint_with_a_judge(renderer):
    import httpx

    from flywheel.core.judge_client import JudgeClient
    from flywheel.teacher.hints import HintExtractor

    reply = "[HINT_START]Give only the number 8.[HINT_END]\nDecision: \\boxed{1}"
    client = JudgeClient(
        "http://judge/v1",
        "m",
        max_attempts=1,
        transport=httpx.MockTransport(
            lambda r: httpx.Response(200, json={"choices": [{"message": {"content": reply}}]})
        ),
        metrics=judge_metrics("teacher"),
    )
    hints = HintExtractor(client, votes=2)
    teacher = Teacher(FakeScorer(), renderer, TeacherConfig(model_name="teach"), hints)
    port = free_port(56100)
    server = serve(TeacherServicer(teacher, "fp", "fp", hints), "127.0.0.1", port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            out = teacher_pb2_grpc.TeacherServiceStub(channel).ExtractHint(
                teacher_pb2.ExtractHintRequest(sample=live_sample(renderer))
            )
    finally:
        server.stop(grace=0)
    assert (out.status, out.hint, out.has_hint) == ("hint", "Give only the number 8.", True)
    assert [(v.has_value, v.value) for v in out.votes] == [(True, 1.0), (True, 1.0)]


def test_teacher_engines_are_separate_unless_self_teacher():
    from flywheel.core.settings import load_settings
    from flywheel.teacher.main import teacher_engine_urls

    s = load_settings(engine={"port": 30000}, teacher={"engine_port": 30100})
    assert teacher_engine_urls(s) == ["http://127.0.0.1:30100"]
    assert "http://127.0.0.1:30100" not in s.trainer_engine_urls()
    s = load_settings(teacher={"self_teacher": True})
    assert teacher_engine_urls(s) == s.trainer_engine_urls() == ["http://127.0.0.1:30000"]
    s = load_settings(teacher={"engine_urls": ["http://big-teacher:30000"]})
    assert teacher_engine_urls(s) == ["http://big-teacher:30000"]
