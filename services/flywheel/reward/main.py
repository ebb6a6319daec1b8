"""Reward service entry point: `python -m flywheel.reward [--config FILE]`.

Parse settings -> user-defined reward plugins (`reward.plugins`; one that fails to import stops
the service here, with its message) -> scorers (verifiers, enabled judges) -> gRPC server (Score,
ScoreBatch, health, reflection) -> Prometheus /metrics -> stream worker (rollouts -> scored, or
-> train when the teacher is disabled), all on one asyncio loop until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from flywheel.core.logs import setup_logging
from flywheel.core.settings import FlywheelSettings, load_settings_or_exit

log = logging.getLogger("flywheel.reward")


def _redacted(settings: FlywheelSettings) -> str:
    data = json.loads(settings.dump())
    for name in ("judge", "step_judge", "rubric_judge"):
        if data["reward"][name].get("api_key"):
            data["reward"][name]["api_key"] = "<redacted>"
    return json.dumps(data, sort_keys=True)


async def serve(settings: FlywheelSettings) -> None:
    """Run the gRPC server and the stream worker until SIGTERM/SIGINT."""
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.streams import (  # noqa: PLC0415
        StreamConsumer,
        StreamProducer,
    )
    from flywheel.reward.factory import build_scorer  # noqa: PLC0415
    from flywheel.reward.grpc_api import start_server  # noqa: PLC0415
    from flywheel.reward.worker import RewardWorker  # noqa: PLC0415

    rs, streams = settings.reward, settings.streams
    client = connect(settings.redis_url())
    consumer = StreamConsumer.in_deployment(client, streams, "rollouts", "reward", rs.consumer_name)
    producer = StreamProducer(
        client,
        settings.next_stream_after_reward(),
        high_water=streams.high_water,
        watch_group="teacher" if settings.teacher.enabled else "trainer",
    )
    scorer = build_scorer(rs)
    worker = RewardWorker(
        consumer,
        producer,
        scorer,
        block_ms=streams.block_ms,
        max_in_flight=rs.max_in_flight,
        sample_timeout_s=rs.sample_timeout_s,
        max_failures=rs.max_failures,
        breaker_samples=rs.breaker_samples,
        breaker_pause_s=rs.breaker_pause_s,
    )
    server = await start_server(
        rs.host, rs.port, scorer, max_batch=rs.max_batch, max_concurrency=rs.max_in_flight
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("reward service on %s:%d -> %s", rs.host, rs.port, producer.stream)
    try:
        await worker.run()
    finally:
        await server.stop(grace=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flywheel-reward", description=__doc__)
    parser.add_argument("--config", default=None, help="TOML settings file")
    args = parser.parse_args(argv)
    settings = load_settings_or_exit(args.config, "flywheel-reward")
    setup_logging(settings.log_level, service="reward")
    log.info("settings %s", _redacted(settings))
    from flywheel.core.errors import ConfigurationError  # noqa: PLC0415
    from flywheel.reward.factory import load_reward_plugins  # noqa: PLC0415

    try:
        names = load_reward_plugins(settings.reward)
    except ConfigurationError as exc:
        log.error("%s", exc)
        sys.exit(f"flywheel-reward: {exc}")
    if settings.reward.plugins:
        log.info("reward plugins %s registered %s", settings.reward.plugins, names)
    if settings.reward.metrics_port:
        from prometheus_client import start_http_server  # noqa: PLC0415

        start_http_server(settings.reward.metrics_port, addr=settings.reward.host)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
