"""OpenAI-style error JSON: Redis outages are a 503 wherever they are raised."""

from __future__ import annotations

import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient

from flywheel.core.errors import BackpressureError, OverloadedError
from flywheel.core.http_errors import install


def _app() -> FastAPI:
    app = FastAPI()
    install(app)

    @app.middleware("http")
    async def _auth(request, call_next):  # a key lookup in Redis, as the gateway's auth does
        if request.url.path == "/from-middleware":
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379")
        return await call_next(request)

    @app.get("/from-route")
    async def _route():
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379")

    @app.get("/bug")
    async def _bug():
        raise KeyError("x")

    return app


def test_redis_down_is_503_with_retry_after_from_routes_and_middleware():
    client = TestClient(_app(), raise_server_exceptions=False)
    for path in ("/from-route", "/from-middleware"):
        r = client.get(path)
        assert r.status_code == 503, (path, r.text)
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "service_unavailable_error"
    bug = client.get("/bug")
    assert bug.status_code == 500 and bug.json()["error"]["message"] == "internal error: KeyError"


def test_retry_later_errors_answer_their_status_code_and_retry_after():
    app = FastAPI()
    install(app)

    @app.get("/backlog")
    async def _backlog():
        raise BackpressureError("the train stream is full")  # default wait: 5 s

    @app.get("/busy")
    async def _busy():
        raise OverloadedError("every engine queue is full", retry_after_s=2.4)

    client = TestClient(app, raise_server_exceptions=False)
    backlog, busy = client.get("/backlog"), client.get("/busy")
    assert (backlog.status_code, backlog.headers["retry-after"]) == (429, "5")
    assert backlog.json()["error"]["code"] == "backpressure"
    assert (busy.status_code, busy.headers["retry-after"]) == (503, "2")  # round(2.4) = 2
    assert busy.json()["error"]["code"] == "engine_overloaded"
    assert OverloadedError("busy").retry_after_s == 1.0  # its own default
