"""gRPC API of the reward service (proto/flywheel/v1/reward.proto) on grpc.aio, plus the
standard health service (grpc.health.v1) and server reflection.

Errors are mapped here, in one place, to status codes with google.rpc.Status details (see the
proto's header): INVALID_ARGUMENT + BadRequest for bad Samples and batches, DEADLINE_EXCEEDED,
INTERNAL + ErrorInfo for scorer bugs. Unjudged samples are answers, not errors.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from flywheel._proto import reward_pb2, reward_pb2_grpc, sample_pb2
from flywheel.core.codec import validate_sample
from flywheel.core.errors import ContractError
from flywheel.reward.scoring import Scorer

log = logging.getLogger(__name__)
SERVICE = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


def _status(code: grpc.StatusCode, message: str, detail) -> grpc.Status:
    packed = any_pb2.Any()
    packed.Pack(detail)
    return rpc_status.to_status(
        status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[packed])
    )


def _bad_request(message: str, violations: list[tuple[str, str]]) -> grpc.Status:
    detail = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
            for f, d in violations
        ]
    )
    return _status(grpc.StatusCode.INVALID_ARGUMENT, message, detail)


def _check(sample: sample_pb2.Sample, field: str) -> list[tuple[str, str]]:
    try:
        validate_sample(sample)
    except ContractError as exc:
        return [(field, str(exc))]
    if not sample.messages:
        return [
            (
                f"{field}.messages",
                "a Sample to score needs its messages (the context and the assistant's reply)",
            )
        ]
    return []


def _response(sample: sample_pb2.Sample) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(
        reward=sample.reward,
        has_reward=sample.has_reward,
        rewards=dict(sample.rewards),
        votes=list(sample.votes),
        error=sample.error,
        sample_id=sample.sample_id,
    )


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score and ScoreBatch over the configured Scorer.

    Args:
        scorer: the configured scorers.
        max_batch: most Samples in one ScoreBatch.
        max_concurrency: Samples scored at once by one ScoreBatch call.
    """

    def __init__(self, scorer: Scorer, max_batch: int = 256, max_concurrency: int = 16):
        self.scorer = scorer
        self.max_batch = max_batch
        self.max_concurrency = max_concurrency

    async def Score(
        self,
        request: reward_pb2.ScoreRequest,  # noqa: N802  (gRPC method)
        context: grpc.aio.ServicerContext,
    ) -> reward_pb2.ScoreResponse:
        if not request.HasField("sample"):
            await context.abort_with_status(
                _bad_request("ScoreRequest.sample is required", [("sample", "missing")])
            )
        violations = _check(request.sample, "sample")
        if violations:
            await context.abort_with_status(
                _bad_request(f"invalid Sample: {violations[0][1]}", violations)
            )
        sample = sample_pb2.Sample()
        sample.CopyFrom(request.sample)
        await self._score([sample], context)
        return _response(sample)

    async def ScoreBatch(
        self,
        request: reward_pb2.ScoreBatchRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> reward_pb2.ScoreBatchResponse:
        n = len(request.samples)
        if n == 0 or n > self.max_batch:
            await context.abort_with_status(
                _bad_request(
                    f"ScoreBatch needs 1 to {self.max_batch} samples, got {n}; split the batch",
                    [("samples", f"{n} samples; allowed 1..{self.max_batch}")],
                )
            )
        violations = [v for i, s in enumerate(request.samples) for v in _check(s, f"samples[{i}]")]
        if violations:
            await context.abort_with_status(
                _bad_request(
                    f"{len(violations)} invalid Sample(s); first: {violations[0][1]}", violations
                )
            )
        samples = []
        for s in request.samples:
            copy = sample_pb2.Sample()
            copy.CopyFrom(s)
            samples.append(copy)
        await self._score(samples, context)
        return reward_pb2.ScoreBatchResponse(responses=[_response(s) for s in samples])

    async def _score(
        self, samples: list[sample_pb2.Sample], context: grpc.aio.ServicerContext
    ) -> None:
        slots = asyncio.Semaphore(self.max_concurrency)

        async def one(sample: sample_pb2.Sample) -> None:
            async with slots:
                await self.scorer.score(sample)

        remaining = context.time_remaining() if context is not None else None
        try:
            async with asyncio.timeout(remaining):
                await asyncio.gather(*(one(s) for s in samples))
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"scoring {len(samples)} sample(s) outlived the call deadline",
            )
        except Exception as exc:
            log.exception("scorer failed")
            await context.abort_with_status(
                _status(
                    grpc.StatusCode.INTERNAL,
                    f"scorer failed: {type(exc).__name__}: {exc}",
                    error_details_pb2.ErrorInfo(
                        reason="SCORER_FAILED",
                        domain="flywheel.reward",
                        metadata={"exception": type(exc).__name__},
                    ),
                )
            )


async def start_server(
    host: str, port: int, scorer: Scorer, *, max_batch: int = 256, max_concurrency: int = 16
) -> grpc.aio.Server:
    """Start the aio server (RewardService, grpc.health.v1, reflection) on the running loop.

    Returns the started server; `await server.stop(grace)` stops it.
    Raises:
        RuntimeError: the port could not be bound.
    """
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(
        RewardServicer(scorer, max_batch, max_concurrency), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise RuntimeError(f"cannot bind the reward gRPC port {host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    return server
