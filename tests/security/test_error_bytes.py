"""Every OpenAI-format error body the gateway sends is serialized the same way (compact JSON,
as FastAPI's handlers write it): the 401 and 403 of the security middleware byte for byte like
the 400 of request validation. Real gateway app, real Redis and tokenizer."""

from __future__ import annotations

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_authentication_authorization_and_validation_errors_have_the_same_bytes(gateway):
    unauthenticated = gateway.client.post("/v1/chat/completions", json=CHAT)
    agent = gateway.auth(gateway.key("agent"))
    forbidden = gateway.client.get("/v1/admin/keys", headers=agent)
    invalid = gateway.client.post(
        "/v1/chat/completions", json={**CHAT, "stream": "yes"}, headers=agent
    )

    assert unauthenticated.status_code == 401
    assert unauthenticated.content == (
        b'{"error":{"message":"missing API key: send `Authorization: Bearer <key>` or '
        b'`x-api-key: <key>` (create keys with `flywheel keys create`)",'
        b'"type":"authentication_error","param":null,"code":"invalid_api_key"}}'
    )
    assert unauthenticated.headers["content-length"] == str(len(unauthenticated.content))
    assert forbidden.status_code == 403
    assert forbidden.content == (
        b'{"error":{"message":"/v1/admin/keys needs an admin key",'
        b'"type":"permission_error","param":null,"code":null}}'
    )
    assert invalid.status_code == 400
    assert invalid.content == (
        b'{"error":{"message":"Invalid type for \'stream\': expected a boolean, but got a '
        b'string instead.","type":"invalid_request_error","param":"stream","code":null}}'
    )
