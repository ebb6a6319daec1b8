"""The dashboard's key form (`POST /dashboard/login`) and the page's answers to wrong keys,
on the gateway app with real Redis (security/conftest.py)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from flywheel.gateway.dashboard import COOKIE

from .conftest import build_gateway


def _login(gateway, key: str):
    return gateway.client.post("/dashboard/login", data={"key": key}, follow_redirects=False)


def test_a_wrong_key_gets_the_form_again_with_an_error(gateway):
    gateway.key("admin")
    reply = _login(gateway, "fwk-not-a-key")
    assert reply.status_code == 401
    assert reply.headers["content-type"].startswith("text/html")
    assert "that key is not valid" in reply.text and 'action="/dashboard/login"' in reply.text
    assert not reply.cookies.get(COOKIE)


def test_an_agent_key_gets_the_html_page_saying_an_admin_key_is_needed(gateway):
    agent = gateway.key("agent")
    reply = _login(gateway, agent)
    assert reply.status_code == 403
    assert reply.headers["content-type"].startswith("text/html")
    assert "that key is not an admin key" in reply.text
    assert "the dashboard needs an admin key" in reply.text
    page = gateway.client.get("/dashboard", headers=gateway.auth(agent))
    assert page.status_code == 403
    assert page.headers["content-type"].startswith("text/html")
    assert "the dashboard needs an admin key" in page.text
    assert 'action="/dashboard/login"' in page.text
    api = gateway.client.get("/dashboard/api/curves", headers=gateway.auth(agent))
    assert api.status_code == 403 and api.json()["error"]["type"] == "permission_error"


def _everything_in_redis(gateway) -> bytes:
    out = []
    for key in gateway.redis.scan_iter(f"{gateway.prefix}:*"):
        out.append(key)
        if gateway.redis.type(key) == b"string":
            out.append(gateway.redis.get(key))
    return b"\n".join(out)


def _browser(gateway, token: str, path: str = "/dashboard"):
    gateway.client.cookies.clear()
    return gateway.client.get(path, headers={"Cookie": f"{COOKIE}={token}"})


def test_the_cookie_holds_a_login_token_not_the_key(gateway, redis_client, prefix, renderer):
    admin = gateway.key("admin")
    reply = _login(gateway, admin)
    assert reply.status_code == 303 and reply.headers["location"] == "/dashboard"
    header = reply.headers["set-cookie"]
    token = reply.cookies[COOKIE]
    assert admin not in header and admin[4:20] not in header and len(token) >= 43
    assert "HttpOnly" in header and "SameSite=Strict" in header and "Path=/dashboard" in header
    assert "Secure" not in header  # plain http
    dump = _everything_in_redis(gateway)
    assert admin.encode() not in dump and admin[4:20].encode() not in dump
    assert token.encode() not in dump
    page = _browser(gateway, token)
    assert page.status_code == 200 and "Training curves" in page.text
    assert _browser(gateway, token, "/dashboard/api/streams").status_code == 200
    # Another replica on the same Redis knows the login.
    other = build_gateway(redis_client, prefix, renderer, auth="on")
    assert _browser(other, token).status_code == 200
    # A raw key in the cookie is no login.
    assert _browser(gateway, admin).status_code == 401

    gateway.keys.revoke(gateway.keys.verify(admin).key_id)
    ended = _browser(gateway, token)
    assert ended.status_code == 401 and 'action="/dashboard/login"' in ended.text
    assert "Max-Age=0" in ended.headers["set-cookie"]
    assert b":dashboard:login:" not in _everything_in_redis(gateway)


def test_over_https_the_cookie_is_secure(gateway):
    admin = gateway.key("admin")
    https = TestClient(gateway.client.app, base_url="https://testserver")
    reply = https.post("/dashboard/login", data={"key": admin}, follow_redirects=False)
    assert reply.status_code == 303
    assert "Secure" in reply.headers["set-cookie"] and "HttpOnly" in reply.headers["set-cookie"]


def test_logging_out_deletes_the_login(gateway):
    admin = gateway.key("admin")
    token = _login(gateway, admin).cookies[COOKIE]
    assert _browser(gateway, token).status_code == 200
    out = gateway.client.post(
        "/dashboard/logout", headers={"Cookie": f"{COOKIE}={token}"}, follow_redirects=False
    )
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
    assert b":dashboard:login:" not in _everything_in_redis(gateway)
    assert _browser(gateway, token).status_code == 401
    assert gateway.client.get("/dashboard", headers=gateway.auth(admin)).status_code == 200
