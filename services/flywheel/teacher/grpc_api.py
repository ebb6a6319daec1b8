"""gRPC API of the teacher service (proto/flywheel/v1/teacher.proto), grpc.health.v1 and server
reflection (so `grpcurl` can list and call it without the proto files).

Errors map to gRPC status codes in one place: bad input -> INVALID_ARGUMENT, a foreign vocabulary
-> FAILED_PRECONDITION, misaligned engine rows -> INTERNAL, an engine outage -> UNAVAILABLE.
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from flywheel._proto import sample_pb2, teacher_pb2, teacher_pb2_grpc
from flywheel.core.codec import validate_sample
from flywheel.core.errors import (
    ContractError,
    InvalidRequestError,
    PlatformError,
    UpstreamError,
)
from flywheel.teacher.context import insert_context, message_dicts
from flywheel.teacher.hints import HintExtractor
from flywheel.teacher.pipeline import Teacher
from flywheel.teacher.vocab import VocabularyMismatchError, check_ids_in_vocab, check_same_vocab

SERVICE_NAME = teacher_pb2.DESCRIPTOR.services_by_name["TeacherService"].full_name


def _status(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, VocabularyMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, UpstreamError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class TeacherServicer(teacher_pb2_grpc.TeacherServiceServicer):
    """Args: the pipeline; the student vocabulary fingerprint; the hint judge (None = off)."""

    def __init__(
        self,
        teacher: Teacher,
        student_fingerprint: str,
        teacher_fingerprint: str,
        hints: HintExtractor | None = None,
    ):
        self.teacher = teacher
        self.student_fingerprint = student_fingerprint
        self.teacher_fingerprint = teacher_fingerprint
        self.hints = hints

    def ScoreTokens(
        self,
        request: teacher_pb2.ScoreTokensRequest,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> teacher_pb2.ScoreTokensResponse:
        try:
            return self._score_tokens(request)
        except PlatformError as exc:
            context.abort(_status(exc), str(exc))
            raise  # unreachable: abort raises

    def _score_tokens(
        self, request: teacher_pb2.ScoreTokensRequest
    ) -> teacher_pb2.ScoreTokensResponse:
        check_same_vocab(
            request.vocab_fingerprint or self.student_fingerprint,
            self.teacher_fingerprint,
            where=" (request vocab_fingerprint)",
        )
        response_ids = list(request.response_ids)
        if not response_ids:
            raise InvalidRequestError("response_ids is empty: nothing to score")
        if bool(request.messages) == bool(request.context_ids):
            raise InvalidRequestError("give exactly one of messages or context_ids")
        renderer = self.teacher.renderer
        if request.context_ids:
            if request.hint:
                raise InvalidRequestError("a hint can be inserted only into messages, not ids")
            prompt_ids = list(request.context_ids)
            check_ids_in_vocab(prompt_ids, renderer.vocab_size)
        else:
            messages = message_dicts(request.messages)
            if request.hint:
                messages = insert_context(messages, request.hint, self.teacher.config.placement)
            tools = json.loads(request.tools_json) if request.tools_json else None
            prompt_ids = renderer.prompt_ids(messages, tools)
        check_ids_in_vocab(response_ids, renderer.vocab_size)
        scored = self.teacher.scorer.score(prompt_ids, response_ids, request.top_k)
        k = request.top_k
        reply = teacher_pb2.ScoreTokensResponse(
            logprobs=scored.logprobs,
            top_k=k,
            teacher_model=self.teacher.config.model_name,
            teacher_weight_version=scored.weight_version,
            prompt_tokens=len(prompt_ids),
            temperature=1.0,
        )
        for ids, lps in zip(scored.topk_ids, scored.topk_logprobs, strict=True):
            reply.topk_ids.extend(ids + [0] * (k - len(ids)))
            reply.topk_logprobs.extend(lps + [float("-inf")] * (k - len(lps)))
        return reply

    def ExtractHint(
        self,
        request: teacher_pb2.ExtractHintRequest,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> teacher_pb2.ExtractHintResponse:
        if self.hints is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the hint judge is disabled; set teacher.hint_judge.enabled = true",
            )
        assert self.hints is not None  # else context.abort raised
        try:
            result = self.hints.extract(request.sample)
        except InvalidRequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        votes = [
            sample_pb2.Vote(
                judge="hint",
                has_value=v.decision is not None,
                value=float(v.decision or 0),
                explanation=v.hint if v.decision is not None else v.reason,
            )
            for v in result.votes
        ]
        return teacher_pb2.ExtractHintResponse(
            hint=result.hint, has_hint=bool(result.hint), votes=votes, status=result.status
        )

    def ScoreSample(
        self,
        request: teacher_pb2.ScoreSampleRequest,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> teacher_pb2.ScoreSampleResponse:
        sample = sample_pb2.Sample()
        sample.CopyFrom(request.sample)
        try:
            validate_sample(sample)
        except ContractError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            self.teacher.process(sample)
        except PlatformError as exc:
            context.abort(_status(exc), str(exc))
        return teacher_pb2.ScoreSampleResponse(sample=sample)


def serve(servicer: TeacherServicer, host: str, port: int, workers: int = 8) -> grpc.Server:
    """Start the gRPC server (TeacherService + health + reflection) and return it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    teacher_pb2_grpc.add_TeacherServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return server
