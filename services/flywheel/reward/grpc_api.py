"""gRPC API of the reward service (proto/flywheel/v1/reward.proto) plus standard health."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flywheel._proto import reward_pb2, reward_pb2_grpc, sample_pb2
from flywheel.core.codec import validate_sample
from flywheel.core.errors import ContractError
from flywheel.reward.judge import NextStateJudge
from flywheel.reward.scoring import score_sample


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, default_verifier: str, judge: NextStateJudge | None = None,
                 weights: dict[str, float] | None = None):
        self.default_verifier = default_verifier
        self.judge = judge
        self.weights = weights

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext
              ) -> reward_pb2.ScoreResponse:  # noqa: N802  (gRPC method name)
        sample = sample_pb2.Sample()
        sample.CopyFrom(request.sample)
        try:
            validate_sample(sample)
        except ContractError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        scored = score_sample(sample, self.default_verifier, self.weights, self.judge)
        return reward_pb2.ScoreResponse(
            reward=scored.reward, has_reward=scored.has_reward, rewards=dict(scored.rewards),
            votes=list(scored.votes), error=scored.error,
        )


def serve(host: str, port: int, default_verifier: str, workers: int = 4,
          judge: NextStateJudge | None = None,
          weights: dict[str, float] | None = None) -> grpc.Server:
    """Start the gRPC server (RewardService + grpc.health.v1) and return it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    reward_pb2_grpc.add_RewardServiceServicer_to_server(
        RewardServicer(default_verifier, judge, weights), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("flywheel.v1.RewardService", health_pb2.HealthCheckResponse.SERVING)
    return server
