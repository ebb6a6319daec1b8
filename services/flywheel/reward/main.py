"""Reward service entry point: `python -m flywheel.reward [--config FILE]`.

Parse settings -> gRPC server (Score + health) -> Prometheus metrics -> stream worker loop
(rollouts -> scored, or -> train when the teacher is disabled) until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal

from flywheel.core.logs import setup_logging
from flywheel.core.settings import load_settings

log = logging.getLogger("flywheel.reward")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flywheel-reward", description=__doc__)
    parser.add_argument("--config", default=None, help="TOML settings file")
    args = parser.parse_args(argv)
    settings = load_settings(args.config)
    setup_logging(settings.log_level, service="reward")
    log.info("settings %s", settings.dump())

    from prometheus_client import start_http_server  # noqa: PLC0415

    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.streams import (  # noqa: PLC0415
        StreamConsumer,
        StreamProducer,
        default_consumer_name,
    )
    from flywheel.reward.grpc_api import serve  # noqa: PLC0415
    from flywheel.reward.judge import judge_from_settings  # noqa: PLC0415
    from flywheel.reward.worker import RewardWorker  # noqa: PLC0415

    rs, streams = settings.reward, settings.streams
    client = connect(settings.redis_url())
    consumer = StreamConsumer(
        client, streams.key("rollouts"), "reward", rs.consumer_name or default_consumer_name(),
        dead_stream=streams.key("dead"), max_deliveries=streams.max_deliveries,
        min_idle_ms=streams.min_idle_ms,
    )
    producer = StreamProducer(client, settings.next_stream_after_reward())
    judge = judge_from_settings(rs.judge)
    worker = RewardWorker(consumer, producer, rs.default_verifier, block_ms=streams.block_ms,
                          judge=judge, weights=rs.weights)
    server = serve(rs.host, rs.port, rs.default_verifier, judge=judge, weights=rs.weights)
    if rs.metrics_port:
        start_http_server(rs.metrics_port, addr=rs.host)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    log.info("reward service on %s:%d -> %s", rs.host, rs.port, producer.stream)
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=2)


if __name__ == "__main__":
    main()
