"""Start the engine: `python -m flywheel.engine [--config FILE] [--model-path DIR] [--port N]`.

Reads the `engine` section of the Flywheel settings, converts the default SmolLM2 model on first
use (when `engine.model_path` is empty), starts the worker thread (the model loads in the
background: /healthz answers at once, /health is 503 until the model is ready), and serves the
SGLang-compatible HTTP API with uvicorn.
"""

from __future__ import annotations

import argparse
import logging
import sys

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import EngineSettings, load_settings_or_exit

log = logging.getLogger("flywheel.engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flywheel.engine", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", help="TOML settings file (default: $FLYWHEEL_CONFIG)")
    parser.add_argument(
        "--model-path", help="Hugging Face model folder (overrides engine.model_path)"
    )
    parser.add_argument("--host", help="bind address (overrides engine.host)")
    parser.add_argument("--port", type=int, help="port (overrides engine.port)")
    parser.add_argument("--weight-version", help="initial weight version label")
    return parser.parse_args(argv)


def engine_settings(args: argparse.Namespace) -> tuple[EngineSettings, str]:
    """The engine section with command-line overrides applied, and the log level."""
    overrides = {
        key: value
        for key, value in {
            "model_path": args.model_path,
            "host": args.host,
            "port": args.port,
            "weight_version": args.weight_version,
        }.items()
        if value is not None
    }
    settings = load_settings_or_exit(
        args.config, "flywheel-engine", **({"engine": overrides} if overrides else {})
    )
    return settings.engine, settings.log_level


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings, log_level = engine_settings(args)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log.info("engine settings %s", settings.model_dump_json())

    from flywheel.core.cpu_libs import without_triton
    from flywheel.core.heap import return_freed_tensors

    return_freed_tensors()  # before the model loads: a swapped-out version is given back
    without_triton()  # on a CPU: torch._dynamo's probe would load libtriton (75 MiB)
    from transformers import AutoConfig  # heavy imports only after the settings parsed

    from flywheel.core.paths import resolve_model_path
    from flywheel.core.serving import serve
    from flywheel.engine.app import EngineDeps, create_app
    from flywheel.engine.context import check_context_length
    from flywheel.engine.convert import ensure_default_model
    from flywheel.engine.worker import EngineWorker

    try:
        model_path = resolve_model_path(settings.model_path)
    except ConfigurationError as exc:
        sys.exit(f"flywheel-engine: {exc} ([engine] model_path, FLYWHEEL_ENGINE__MODEL_PATH)")
    if not settings.model_path:
        model_path = ensure_default_model(model_path)
    try:
        check_context_length(settings, AutoConfig.from_pretrained(model_path))
    except ConfigurationError as exc:
        sys.exit(f"flywheel-engine: {exc}")
    worker = EngineWorker(settings, model_path).start()
    app = create_app(EngineDeps(engine=worker, settings=settings, model_path=model_path))
    try:
        # Generations still running 5 s after SIGTERM are answered 503, counted in one line.
        serve(app, host=settings.host, port=settings.port, log_level=log_level)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
