"""A session id in the URL is the segment as sent: `GET /v1/sessions/a%2Fb` names the id "a/b",
which is no session id (1-128 letters, digits and `_ . : -`), and gets a 400 saying so, not
"session a not found" from the decoded path cut at its slash; a percent-encoded valid id still
names its session. On a Messages path the 400 is in Anthropic's error format (fake engine, real
Redis and tokenizer)."""

import pytest

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/sessions/a%2Fb", None),
        ("GET", "/v1/sessions/a%2fb", None),
        ("POST", "/v1/sessions/a%2Fb/finish", {}),
        ("POST", "/v1/sessions/a%2Fb/reward", {"reward": 1.0}),
        ("POST", "/s/a%2Fb/v1/chat/completions", {"model": "m", "messages": U}),
        ("GET", "/v1/sessions/a%20b", None),
    ],
)
def test_an_encoded_invalid_session_id_is_a_400_about_that_id(
    redis_client, prefix, renderer, method, path, body
):
    client, engine = _client(redis_client, prefix, renderer)
    client.post("/v1/sessions", json={"session_id": "a"})  # "a" exists: not what is asked
    resp = client.request(method, path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == ("session_id", "invalid_request_error")
    named = "a/b" if "%2" in path.lower() and "%20" not in path else "a b"
    assert f"'{named}'" in error["message"], error
    assert "session a not found" not in error["message"]
    assert engine.prompts == []


@pytest.mark.parametrize("tail", ["/v1/messages", "/v1/messages/count_tokens"])
def test_an_encoded_invalid_session_id_on_messages_is_an_anthropic_400(
    redis_client, prefix, renderer, tail
):
    client, engine = _client(redis_client, prefix, renderer)
    client.post("/v1/sessions", json={"session_id": "a"})
    body = {"model": "m", "max_tokens": 8, "messages": U}
    resp = client.post(f"/s/a%2Fb{tail}", json=body)
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "'a/b'" in answer["error"]["message"], answer
    assert engine.prompts == []


def test_an_encoded_valid_session_id_names_its_session(redis_client, prefix, renderer):
    client, _ = _client(redis_client, prefix, renderer)
    made = client.post("/v1/sessions", json={"session_id": "x:y"})
    assert made.status_code == 200, made.text
    got = client.get("/v1/sessions/x%3Ay")
    assert got.status_code == 200 and got.json()["session_id"] == "x:y", got.text
    missing = client.get("/v1/sessions/x%3Az")
    assert missing.status_code == 404 and "x:z" in missing.json()["error"]["message"]


def test_an_agent_key_is_told_about_the_id_it_sent(redis_client, prefix, renderer):
    from flywheel.core.auth import KeyStore

    client, _ = _client(redis_client, prefix, renderer)
    key, _ = KeyStore(redis_client, prefix).create("agent", name="t")
    bearer = {"Authorization": f"Bearer {key}"}
    assert client.post("/v1/sessions", json={"session_id": "a"}, headers=bearer).status_code == 200
    resp = client.get("/v1/sessions/a%2Fb", headers=bearer)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "session_id" and "'a/b'" in error["message"], error
    assert client.get("/v1/sessions/a", headers=bearer).status_code == 200  # its own session
