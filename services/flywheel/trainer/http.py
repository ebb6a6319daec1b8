"""The trainer's HTTP surface: /healthz, /readyz, /status, /metrics (served in a thread)."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flywheel.trainer.telemetry import TrainerStatus


def create_app(status: TrainerStatus) -> FastAPI:
    app = FastAPI(  # no Host-built redirect for a trailing slash: a 404
        title="flywheel trainer", docs_url=None, redoc_url=None, redirect_slashes=False
    )

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ready = status.snapshot()["ready"]
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/status")
    def status_json() -> dict:
        return status.snapshot()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_in_thread(app: FastAPI, host: str, port: int, timeout_s: float = 10.0) -> uvicorn.Server:
    """Start uvicorn on a daemon thread and wait until it listens; stop with `should_exit`.

    Raises:
        RuntimeError: the server did not start within `timeout_s` seconds (port taken?).
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="trainer-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"trainer HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    return server
