"""API keys (hashed at rest), roles, authentication modes and control paths."""

from __future__ import annotations

import pytest
from fastapi import Depends

from flywheel.core.auth import KeyStore, hash_key
from flywheel.gateway.access.principal import require_role

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _everything_in_redis(redis_client, prefix) -> bytes:
    out = []
    for key in redis_client.scan_iter(f"{prefix}:*"):
        out.append(key)
        kind = redis_client.type(key)
        if kind == b"string":
            out.append(redis_client.get(key))
        elif kind == b"hash":
            for k, v in redis_client.hgetall(key).items():
                out += [k, v]
    return b"\n".join(out)


def test_keys_are_stored_only_as_sha256_digests(redis_client, prefix):
    store = KeyStore(redis_client, prefix)
    agent, record = store.create("agent", "ci")
    session, _ = store.create("session", session_id="s1", parent=record.key_id, ttl_s=60)
    dump = _everything_in_redis(redis_client, prefix)
    for secret in (agent, session):
        assert secret.encode() not in dump
        assert secret[4:20].encode() not in dump  # not even a fragment of the secret part
    assert hash_key(agent).encode() in dump
    assert store.verify(agent).role == "agent"
    assert store.verify(session).session_id == "s1"
    assert store.verify(agent + "x") is None and store.verify("sk-local") is None
    assert redis_client.ttl(f"{prefix}:apikey:{hash_key(session)}") > 0


def test_list_and_revoke(redis_client, prefix):
    store = KeyStore(redis_client, prefix)
    assert not store.any_keys()
    secret, record = store.create("admin", "ops")
    store.create("session", session_id="s1", ttl_s=60)
    assert [r.key_id for r in store.list()] == [record.key_id]  # session keys not listed
    assert store.any_keys()
    store.revoke(record.key_id)
    assert store.verify(secret) is None and store.keys_left() == 0
    assert store.any_keys()  # a deployment that had keys keeps requiring them


def test_revoking_the_last_key_keeps_the_gateway_closed(make_gateway):
    """auth = "auto" on loopback: open with no keys, closed once a key exists, and still closed
    (every request 401, none served as the local admin) after the only key is revoked."""
    gw = make_gateway(key_cache_s=0)
    assert gw.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    admin = gw.key("admin")
    agent = gw.key("agent")
    revoked = gw.client.delete(
        f"/v1/admin/keys/{gw.keys.verify(agent).key_id}", headers=gw.auth(admin)
    )
    assert revoked.json()["keys_left"] == 1
    last = gw.client.delete(
        f"/v1/admin/keys/{gw.keys.verify(admin).key_id}", headers=gw.auth(admin)
    )
    assert last.status_code == 200 and last.json()["keys_left"] == 0
    served = len(gw.engine.calls)
    for headers in ({}, gw.auth(admin), gw.auth(agent)):
        reply = gw.client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == "invalid_api_key"
    assert gw.client.get("/v1/admin/keys").status_code == 401  # no local admin either
    assert len(gw.engine.calls) == served
    assert (
        gw.client.post(  # a new key works again
            "/v1/chat/completions", json=CHAT, headers=gw.auth(gw.key("agent"))
        ).status_code
        == 200
    )


def test_missing_wrong_and_revoked_keys_get_401(gateway):
    assert gateway.client.get("/healthz").status_code == 200  # health stays public
    no_key = gateway.client.post("/v1/chat/completions", json=CHAT)
    assert no_key.status_code == 401
    assert no_key.json()["error"]["code"] == "invalid_api_key"
    assert no_key.headers["www-authenticate"] == "Bearer"
    bad = gateway.client.get("/v1/models", headers=gateway.auth("fwk-not-a-key"))
    assert bad.status_code == 401
    secret = gateway.key("agent")
    assert gateway.client.get("/v1/models", headers=gateway.auth(secret)).status_code == 200
    gateway.keys.revoke(gateway.keys.verify(secret).key_id)
    assert gateway.client.get("/v1/models", headers=gateway.auth(secret)).status_code == 401
    assert gateway.engine.calls == []


def test_auto_mode_is_off_on_loopback_until_a_key_exists(make_gateway):
    gw = make_gateway()  # auth="auto", host 127.0.0.1
    assert gw.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    gw.key("admin")
    assert gw.client.post("/v1/chat/completions", json=CHAT).status_code == 401


def test_auto_mode_requires_keys_off_loopback(make_gateway):
    gw = make_gateway(host="0.0.0.0")
    assert gw.client.post("/v1/chat/completions", json=CHAT).status_code == 401


def test_off_mode_serves_everyone(make_gateway):
    gw = make_gateway(host="0.0.0.0", auth="off")
    gw.key("agent")
    assert gw.client.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("path", ["/v1/admin/keys", "/dashboard", "/dashboard/api/state"])
def test_control_paths_need_admin(gateway, path):
    app = gateway.client.app

    @app.get("/dashboard", dependencies=[Depends(require_role("admin"))])
    @app.get("/dashboard/api/state", dependencies=[Depends(require_role("admin"))])
    async def dashboard() -> dict:
        return {"ok": True}

    agent, admin = gateway.key("agent"), gateway.key("admin")
    assert gateway.client.get(path).status_code == 401
    denied = gateway.client.get(path, headers=gateway.auth(agent))
    assert denied.status_code == 403
    if path == "/dashboard":  # the page a browser opens: the key form, saying why
        assert "the dashboard needs an admin key" in denied.text
    else:
        assert denied.json()["error"]["type"] == "permission_error"
    assert gateway.client.get(path, headers=gateway.auth(admin)).status_code == 200


def test_require_role_allows_the_local_admin_when_auth_is_off(make_gateway):
    gw = make_gateway()

    @gw.client.app.get("/dashboard", dependencies=[Depends(require_role("admin"))])
    async def dashboard() -> dict:
        return {"ok": True}

    assert gw.client.get("/dashboard").status_code == 200


def test_metrics_need_admin_only_when_configured(make_gateway):
    open_gw = make_gateway(auth="on")
    assert open_gw.client.get("/metrics").status_code == 200
    closed = make_gateway(auth="on", metrics_require_admin=True)
    agent, admin = closed.key("agent"), closed.key("admin")
    assert closed.client.get("/metrics").status_code == 401
    assert closed.client.get("/metrics", headers=closed.auth(agent)).status_code == 403
    assert closed.client.get("/metrics", headers=closed.auth(admin)).status_code == 200


def test_admin_key_routes(gateway):
    admin, agent = gateway.key("admin"), gateway.key("agent")
    made = gateway.client.post(
        "/v1/admin/keys", json={"role": "agent", "name": "ci"}, headers=gateway.auth(admin)
    )
    assert made.status_code == 200 and made.json()["api_key"].startswith("fwk-")
    new = made.json()["api_key"]
    assert gateway.client.get("/v1/models", headers=gateway.auth(new)).status_code == 200
    listed = gateway.client.get("/v1/admin/keys", headers=gateway.auth(admin)).json()["data"]
    assert made.json()["key_id"] in {k["key_id"] for k in listed}
    assert all("api_key" not in k for k in listed)
    assert (
        gateway.client.post(
            "/v1/admin/keys", json={"role": "admin"}, headers=gateway.auth(agent)
        ).status_code
        == 403
    )
    gone = gateway.client.delete(
        f"/v1/admin/keys/{made.json()['key_id']}", headers=gateway.auth(admin)
    )
    assert gone.status_code == 200
    assert gateway.client.get("/v1/models", headers=gateway.auth(new)).status_code == 401


ENGINE_CONTROL = [
    "/generate",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/flush_cache",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/get_model_info",
    "/get_server_info",
    "/server_info",
    "/health_generate",
    "/start_profile",
    "/v1/load_lora_adapter",
]


@pytest.mark.parametrize("path", ENGINE_CONTROL)
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_engine_control_endpoints_are_never_proxied(gateway, path, method):
    admin = gateway.key("admin")
    for prefix in ("", "/s/x", "/v1"):
        resp = gateway.client.request(
            method, prefix + path, json={"model_path": "/tmp/evil"}, headers=gateway.auth(admin)
        )
        assert resp.status_code in (404, 405), (prefix + path, resp.status_code)
    assert gateway.engine.calls == []
