"""The dashboard's key form (`POST /dashboard/login`) and the page's answers to wrong keys,
on the gateway app with real Redis (security/conftest.py)."""

from __future__ import annotations

from flywheel.gateway.dashboard import COOKIE


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

