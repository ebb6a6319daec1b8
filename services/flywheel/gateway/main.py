"""Gateway entry point: `python -m flywheel.gateway [--config FILE] [--port N]`.

Parse settings -> connect Redis -> load the tokenizer -> build the engine pool and the Sample
publisher -> serve the app with uvicorn.
"""

from __future__ import annotations

import argparse
import gc
import logging

from flywheel.core.logs import setup_logging
from flywheel.core.settings import load_settings_or_exit

log = logging.getLogger("flywheel.gateway")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flywheel-gateway", description=__doc__)
    parser.add_argument("--config", default=None, help="TOML settings file")
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    settings = load_settings_or_exit(args.config, "flywheel-gateway")
    if args.port:
        settings.gateway.port = args.port
    setup_logging(settings.log_level, service="gateway")
    log.info("settings %s", settings.dump())

    from flywheel.core.tokenizer_only import without_torch  # noqa: PLC0415

    without_torch()  # the gateway only tokenizes: transformers without torch's 240 MiB
    from flywheel.core.fleet import Fleet, static_urls  # noqa: PLC0415
    from flywheel.core.paths import resolve_model_path  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.retention import StreamRetention  # noqa: PLC0415
    from flywheel.core.serving import serve  # noqa: PLC0415  (uvicorn: after settings parse)
    from flywheel.core.streams import StreamProducer  # noqa: PLC0415
    from flywheel.gateway.app import create_app  # noqa: PLC0415
    from flywheel.gateway.deps import GatewayDeps  # noqa: PLC0415
    from flywheel.gateway.engines.fleet_watch import FleetWatch  # noqa: PLC0415
    from flywheel.gateway.engines.pool import EnginePool  # noqa: PLC0415
    from flywheel.gateway.render.tokenization import ChatRenderer  # noqa: PLC0415
    from flywheel.gateway.session.store import SessionStore  # noqa: PLC0415

    gw = settings.gateway
    client = connect(settings.redis_url(), socket_timeout=gw.redis_timeout_s)
    renderer = ChatRenderer(
        gw.tokenizer_path or resolve_model_path(settings.engine.model_path),
        prefix_cache_bytes=int(gw.prefix_cache_mb * (1 << 20)),
    )
    stop_ids = {renderer.eos_token_id} if renderer.eos_token_id is not None else set()
    pool = EnginePool(
        static_urls(settings),
        gw.request_timeout_s,
        stop_ids,
        health_interval_s=gw.engine_health_interval_s,
        stream_interval=gw.stream_interval,
    )
    fleet = Fleet(client, settings.streams.prefix, static_urls(settings), settings.fleet)
    fleet.seed()  # the configured engines; admin and DNS ones join through the watch
    deps = GatewayDeps(
        settings=gw,
        renderer=renderer,
        engines=pool,
        fleet=FleetWatch(pool, fleet, settings.fleet.refresh_s),
        sessions=SessionStore(
            client,
            settings.streams.prefix,
            gw.session_ttl_s,
            cache_bytes=int(gw.record_cache_mb * (1 << 20)),
        ),
        publisher=StreamProducer(
            client,
            settings.streams.key("rollouts"),
            high_water=settings.streams.high_water,
            watch_group="reward",
        ),
        context_length=settings.engine.context_length,
        retention=StreamRetention(
            client,
            settings.streams.prefix,
            [settings.streams.key(s) for s in ("rollouts", "scored", "train")],
            settings.streams.retention_s,
            settings.streams.retention_check_s,
        ),
    )
    app = create_app(deps)
    # What start-up loaded (tokenizer, chat template, libraries: over a million objects) lives
    # as long as the process: frozen out of the collector's reach, a full collection scans only
    # what requests made. Unfrozen, each one took 400-600 ms every second or two at concurrency
    # 64, the p99 tail of bench/peers/gateway_overhead.py.
    gc.freeze()
    # Requests still in flight 5 s after SIGTERM are answered 503 and counted in one line.
    serve(app, host=gw.host, port=gw.port, log_level="warning")


if __name__ == "__main__":
    main()
