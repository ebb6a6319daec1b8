"""Reward service: verifiable rewards (and, later, judges) over the rollouts stream and gRPC."""
