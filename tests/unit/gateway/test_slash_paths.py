"""A path with a trailing slash is not one the API serves: it gets a 404 in the API's error
format, never a redirect whose `location` is built from the request's Host header (an open
redirect) (fake engine, real Redis and tokenizer; the engine's and trainer's apps alike)."""

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flywheel.core.settings import EngineSettings
from flywheel.engine.app import EngineDeps
from flywheel.engine.app import create_app as engine_app
from flywheel.trainer.http import create_app as trainer_app
from flywheel.trainer.telemetry import TrainerStatus

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

EVIL = {"host": "evil.example"}
U = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions/", "/v1/completions/", "/v1/responses/", "/v1/models/"]
)
def test_openai_paths_with_a_trailing_slash_are_openai_404s(redis_client, prefix, renderer, path):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post(
        path, json={"model": "m", "messages": U}, headers=EVIL, follow_redirects=False
    )
    assert resp.status_code == 404 and "location" not in resp.headers, resp.headers
    assert resp.json()["error"]["type"] == "not_found_error", resp.text
    assert engine.prompts == []


@pytest.mark.parametrize("path", ["/v1/messages/", "/s/abc/v1/messages/"])
def test_messages_paths_with_a_trailing_slash_are_anthropic_404s(
    redis_client, prefix, renderer, path
):
    client, engine = _client(redis_client, prefix, renderer)
    body = {"model": "m", "max_tokens": 8, "messages": U}
    resp = client.post(path, json=body, headers=EVIL, follow_redirects=False)
    assert resp.status_code == 404 and "location" not in resp.headers, resp.headers
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "not_found_error", answer
    assert engine.prompts == []


def test_session_and_dashboard_paths_are_served_without_the_redirect(
    redis_client, prefix, renderer
):
    client, _ = _client(redis_client, prefix, renderer)
    created = client.post("/v1/sessions", json={}).json()
    sid = created["session_id"]
    assert client.get(f"/v1/sessions/{sid}").json()["session_id"] == sid
    chat = client.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": U})
    assert chat.status_code == 200, chat.text
    assert client.get(f"/s/{sid}/v1/models").status_code == 200
    page = client.get("/dashboard")
    assert page.status_code == 200 and "dashboard" in page.text.lower()
    slash = client.get(f"/v1/sessions/{sid}/", headers=EVIL, follow_redirects=False)
    assert slash.status_code == 404 and "location" not in slash.headers


def test_engine_and_trainer_apps_do_not_redirect_a_trailing_slash(tmp_path: Path):
    deps = EngineDeps(engine=None, settings=EngineSettings(), model_path=tmp_path)  # type: ignore[arg-type]
    apps = [engine_app(deps), trainer_app(TrainerStatus())]
    for app in apps:
        resp = TestClient(app).get("/healthz/", headers=EVIL, follow_redirects=False)
        assert resp.status_code == 404 and "location" not in resp.headers, resp.headers
