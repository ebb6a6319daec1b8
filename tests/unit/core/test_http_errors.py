"""OpenAI-style error JSON: Redis outages are a 503 wherever they are raised."""

from __future__ import annotations

import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient

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
