"""Scoped sessions: no key reads, rewards, finishes or sends turns into another key's session.

Every session endpoint is tried in each way a session can be named (URL prefix, /v1/sessions/<id>
path, X-Session-Id header, per-session key); a foreign key gets the same 404 as for a missing
session, and the session is left exactly as it was.
"""

from __future__ import annotations

import pytest

from flywheel.core.errors import NotFoundError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}]}
TEXT = {"model": "m", "prompt": "7 + 1 =", "max_tokens": 4}
COUNT = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}]}
MESSAGE = {**COUNT, "max_tokens": 4}
RESPONSE = {"model": "m", "input": "What is 7 + 1?", "max_output_tokens": 4}

# (method, path, body, use the X-Session-Id header instead of the path)
SESSION_ENDPOINTS = [
    ("GET", "/v1/sessions/{sid}", None, False),
    ("GET", "/s/{sid}/v1/models", None, False),
    ("POST", "/v1/sessions/{sid}/reward", {"reward": 1.0}, False),
    ("POST", "/s/{sid}/v1/chat/completions", CHAT, False),
    ("POST", "/v1/chat/completions", CHAT, True),
    ("POST", "/s/{sid}/v1/completions", TEXT, False),
    ("POST", "/v1/completions", TEXT, True),
    ("POST", "/s/{sid}/v1/messages", MESSAGE, False),
    ("POST", "/v1/messages", MESSAGE, True),
    ("POST", "/s/{sid}/v1/messages/count_tokens", COUNT, False),
    ("POST", "/v1/messages/count_tokens", COUNT, True),
    ("POST", "/s/{sid}/v1/responses", RESPONSE, False),
    ("POST", "/v1/responses", RESPONSE, True),
    ("POST", "/v1/sessions/{sid}/keys", {}, False),
    ("POST", "/v1/sessions/{sid}/finish", {"reward": 1.0}, False),
]
# Stored responses under a session (tested by test_stored_responses_of_a_session_...).
STORED_RESPONSE_ROUTES = {
    ("GET", "/s/{sid}/v1/responses/{response_id}"),
    ("DELETE", "/s/{sid}/v1/responses/{response_id}"),
    ("GET", "/s/{sid}/v1/responses/{response_id}/input_items"),
    ("POST", "/s/{sid}/v1/responses/{response_id}/cancel"),
}


def _call(gw, secret, method, path, body, header, sid):
    headers = gw.auth(secret)
    if header:
        headers["X-Session-Id"] = sid
    return gw.client.request(method, path.format(sid=sid), json=body, headers=headers)


def _create(gw, secret, **body):
    resp = gw.client.post("/v1/sessions", json={"group_id": "g", **body}, headers=gw.auth(secret))
    assert resp.status_code == 200, resp.text
    return resp.json()["session_id"]


def _snapshot(gw, sid):
    record = gw.sessions.get(sid)
    return (
        record.status,
        record.turns,
        dict(record.rewards),
        record.segment.token_ids,
        gw.redis.xlen(f"{gw.prefix}:rollouts"),
    )


@pytest.mark.parametrize(("method", "path", "body", "header"), SESSION_ENDPOINTS)
def test_foreign_agent_key_gets_404_and_changes_nothing(gateway, method, path, body, header):
    owner, intruder = gateway.key("agent", "owner"), gateway.key("agent", "intruder")
    sid = _create(gateway, owner)
    before = _snapshot(gateway, sid)
    resp = _call(gateway, intruder, method, path, body, header, sid)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["type"] == "not_found_error"
    if not header:  # (an unknown X-Session-Id creates a live session for the key instead)
        missing = _call(gateway, intruder, method, path, body, header, "no-such-session")
        assert missing.status_code == 404  # indistinguishable from a missing session
    assert _snapshot(gateway, sid) == before
    assert gateway.engine.calls == []


@pytest.mark.parametrize(("method", "path", "body", "header"), SESSION_ENDPOINTS)
def test_owner_and_admin_may_use_the_session(gateway, method, path, body, header):
    owner, admin = gateway.key("agent"), gateway.key("admin")
    for secret in (owner, admin):
        sid = _create(gateway, owner)
        resp = _call(gateway, secret, method, path, body, header, sid)
        assert resp.status_code == 200, resp.text


def test_every_session_endpoint_is_listed(gateway):
    """A new session route must be added to SESSION_ENDPOINTS (and so get the foreign-key test)."""
    listed = {(m, p) for m, p, _, header in SESSION_ENDPOINTS if not header}
    listed |= STORED_RESPONSE_ROUTES
    routes = {
        (m, r.path.replace("{session_id}", "{sid}"))
        for r in gateway.client.app.routes
        for m in getattr(r, "methods", ()) or ()
        if "{session_id}" in getattr(r, "path", "")
    }
    assert routes <= listed, routes - listed


def test_stored_responses_of_a_session_are_its_owners_only(gateway):
    """GET/DELETE /s/<sid>/v1/responses/<id> (and its input_items and cancel): a foreign key
    gets the 404 of a missing session and deletes nothing; the owner reads its stored response
    and its input items (cancel: OpenAI's 400 for a response not made in background), then
    deletes it."""
    owner, intruder = gateway.key("agent"), gateway.key("agent")
    sid = _create(gateway, owner)
    made = gateway.client.post(f"/s/{sid}/v1/responses", json=RESPONSE, headers=gateway.auth(owner))
    assert made.status_code == 200, made.text
    path = f"/s/{sid}/v1/responses/{made.json()['id']}"
    for method, where in [
        ("GET", path),
        ("DELETE", path),
        ("GET", f"{path}/input_items"),
        ("POST", f"{path}/cancel"),
    ]:
        foreign = gateway.client.request(method, where, headers=gateway.auth(intruder))
        assert foreign.status_code == 404, foreign.text
        assert foreign.json()["error"]["type"] == "not_found_error"
    items = gateway.client.get(f"{path}/input_items", headers=gateway.auth(owner))
    assert items.status_code == 200 and items.json()["object"] == "list", items.text
    cancel = gateway.client.post(f"{path}/cancel", headers=gateway.auth(owner))
    assert cancel.status_code == 400, cancel.text
    got = gateway.client.get(path, headers=gateway.auth(owner))
    assert got.status_code == 200 and got.json()["id"] == made.json()["id"]
    assert gateway.client.delete(path, headers=gateway.auth(owner)).status_code == 200
    assert gateway.client.get(path, headers=gateway.auth(owner)).status_code == 404


def test_turns_with_a_foreign_key_do_not_reach_the_engine_or_the_record(gateway):
    owner, intruder = gateway.key("agent"), gateway.key("agent")
    sid = _create(gateway, owner)
    ok = gateway.client.post(
        f"/s/{sid}/v1/chat/completions", json=CHAT, headers=gateway.auth(owner)
    )
    assert ok.status_code == 200
    before = _snapshot(gateway, sid)
    hijack = gateway.client.post(
        "/v1/chat/completions", json=CHAT, headers={**gateway.auth(intruder), "X-Session-Id": sid}
    )
    assert hijack.status_code == 404
    assert _snapshot(gateway, sid) == before and len(gateway.engine.calls) == 1


def test_live_session_created_by_header_belongs_to_its_key(gateway):
    owner, intruder = gateway.key("agent"), gateway.key("agent")
    headers = {**gateway.auth(owner), "X-Session-Id": "live-1"}
    assert (
        gateway.client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    )
    assert gateway.sessions.get("live-1").owner == gateway.keys.verify(owner).key_id
    stolen = gateway.client.get("/v1/sessions/live-1", headers=gateway.auth(intruder))
    assert stolen.status_code == 404


class TestSessionKey:
    """A key minted for one session: routed to it, and good for nothing else."""

    def _mint(self, gw):
        owner = gw.key("agent")
        sid = _create(gw, owner)
        minted = gw.client.post(f"/v1/sessions/{sid}/keys", json={}, headers=gw.auth(owner))
        assert minted.status_code == 200, minted.text
        return owner, sid, minted.json()

    def test_plain_v1_requests_are_routed_to_its_session(self, gateway):
        _, sid, minted = self._mint(gateway)
        assert minted["base_url"] == "http://testserver/v1"
        resp = gateway.client.post(
            "/v1/chat/completions", json=CHAT, headers=gateway.auth(minted["api_key"])
        )
        assert resp.status_code == 200, resp.text
        assert gateway.sessions.get(sid).turns == 1  # recorded in the session, not unrecorded

    @pytest.mark.parametrize(
        ("method", "path", "body"),
        [
            ("GET", "/v1/sessions/{sid}", None),
            ("POST", "/v1/sessions/{sid}/finish", {"reward": 1.0}),
            ("POST", "/v1/sessions/{sid}/reward", {"reward": 1.0}),
            ("POST", "/v1/sessions/{sid}/keys", {}),
            ("POST", "/v1/sessions", {}),
            ("GET", "/v1/admin/keys", None),
        ],
    )
    def test_cannot_read_reward_finish_or_create(self, gateway, method, path, body):
        _, sid, minted = self._mint(gateway)
        resp = gateway.client.request(
            method, path.format(sid=sid), json=body, headers=gateway.auth(minted["api_key"])
        )
        assert resp.status_code == 403, resp.text
        assert resp.json()["error"]["type"] == "permission_error"
        assert gateway.sessions.get(sid).status == "open"

    def test_cannot_reach_another_session(self, gateway):
        owner, _, minted = self._mint(gateway)
        other = _create(gateway, owner)
        key = gateway.auth(minted["api_key"])
        by_url = gateway.client.post(f"/s/{other}/v1/chat/completions", json=CHAT, headers=key)
        by_header = gateway.client.post(
            "/v1/chat/completions", json=CHAT, headers={**key, "X-Session-Id": other}
        )
        assert by_url.status_code == 404 and by_header.status_code == 404
        assert gateway.sessions.get(other).turns == 0 and gateway.engine.calls == []

    def test_works_in_local_mode_too(self, make_gateway):
        gw = make_gateway()  # auto, loopback, no keys: authentication off
        sid = _create(gw, None)
        minted = gw.client.post(f"/v1/sessions/{sid}/keys", json={}).json()
        resp = gw.client.post("/v1/chat/completions", json=CHAT, headers=gw.auth(minted["api_key"]))
        assert resp.status_code == 200 and gw.sessions.get(sid).turns == 1
        # a session key is not an agent/admin key: authentication stays off for everyone else
        assert gw.client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_key_racing_another_keys_first_request_for_one_session_id_is_refused(
    gateway, monkeypatch
):
    """Two keys send their first request with the same new X-Session-Id at once: both pass the
    access check while the session does not exist; the second one's create then finds the
    first one's session and must be refused like any foreign session, not join it."""
    from flywheel.gateway.api import chat

    first, second = gateway.key("agent"), gateway.key("agent")
    first_id = gateway.keys.verify(first).key_id
    original = chat.check_backlog

    async def first_key_creates_meanwhile(d):  # runs between the check and the create
        if not gateway.sessions.exists("race"):
            gateway.sessions.create(session_id="race", mode="live", owner=first_id)
        await original(d)

    monkeypatch.setattr(chat, "check_backlog", first_key_creates_meanwhile)
    late = gateway.client.post(
        "/v1/chat/completions", json=CHAT, headers={**gateway.auth(second), "X-Session-Id": "race"}
    )
    assert late.status_code == 404, late.text
    record = gateway.sessions.get("race")
    assert record.owner == first_id and record.turns == 0 and not gateway.engine.calls
    own = gateway.client.post(
        "/v1/chat/completions", json=CHAT, headers={**gateway.auth(first), "X-Session-Id": "race"}
    )
    assert own.status_code == 200 and gateway.sessions.get("race").turns == 1


def test_a_session_another_key_creates_right_after_the_access_check_is_refused_at_the_turn(
    gateway, monkeypatch
):
    """The other interleaving: the second key's access check finds no session, the first key
    creates it, and the second key's turn then finds it existing (no create of its own): the
    turn itself refuses a session of another key, under the session lock."""
    first, second = gateway.key("agent"), gateway.key("agent")
    first_id = gateway.keys.verify(first).key_id
    original = type(gateway.sessions).aowner

    async def created_right_after_the_check(self, session_id):
        try:
            return await original(self, session_id)
        except NotFoundError:
            self.create(session_id=session_id, mode="live", owner=first_id)
            raise

    monkeypatch.setattr(type(gateway.sessions), "aowner", created_right_after_the_check)
    late = gateway.client.post(
        "/v1/chat/completions", json=CHAT, headers={**gateway.auth(second), "X-Session-Id": "race2"}
    )
    assert late.status_code == 404, late.text
    assert gateway.sessions.get("race2").turns == 0 and not gateway.engine.calls


@pytest.mark.parametrize(("method", "suffix"), [("get", ""), ("post", "/keys")])
def test_reading_or_keying_a_session_created_by_another_key_meanwhile_is_refused(
    gateway, monkeypatch, method, suffix
):
    """Naming the session in the path and in X-Session-Id does not make a missing session pass
    the access check, and a session another key created right after that check is refused by
    the route itself (it used to hand out its record, or a session key for it)."""
    first, second = gateway.key("agent"), gateway.key("agent")
    first_id, second_id = (gateway.keys.verify(k).key_id for k in (first, second))
    headers = {**gateway.auth(second), "X-Session-Id": "victim"}
    missing = getattr(gateway.client, method)(f"/v1/sessions/victim{suffix}", headers=headers)
    assert missing.status_code == 404, missing.text
    original, checked = type(gateway.sessions).aowner, set()

    async def created_right_after_the_check(self, session_id):
        if session_id in checked or not self.exists(session_id):
            checked.add(session_id)  # the check saw no owner to refuse; then the first key
            if not self.exists(session_id):  # creates the session before the route runs
                self.create(session_id=session_id, mode="live", owner=first_id)
            return second_id
        return await original(self, session_id)

    monkeypatch.setattr(type(gateway.sessions), "aowner", created_right_after_the_check)
    late = getattr(gateway.client, method)(
        f"/v1/sessions/victim2{suffix}", headers={**gateway.auth(second), "X-Session-Id": "victim2"}
    )
    assert late.status_code == 404, late.text


def test_a_session_created_before_the_first_key_is_refused_with_the_reason_and_no_leak(
    make_gateway,
):
    """A session created while authentication was off (no owner) is an admin's only once keys
    exist: an agent key gets a 404 whose message says a session may be missing, another key's
    or created without a key, in the API's own error format; a missing session and another
    key's session get the very same words, so nothing tells which one it is."""
    gw = make_gateway(auth="auto")  # loopback, no key yet: served without a key
    unowned = _create(gw, None)
    agent, other, admin = gw.key("agent"), gw.key("agent"), gw.key("admin")  # keys now required
    foreign = _create(gw, other)
    assert gw.client.get(f"/v1/sessions/{unowned}").status_code == 401
    assert gw.client.get(f"/v1/sessions/{unowned}", headers=gw.auth(admin)).status_code == 200

    def refusal(sid: str) -> dict:
        resp = gw.client.get(f"/v1/sessions/{sid}", headers=gw.auth(agent))
        assert resp.status_code == 404, resp.text
        return resp.json()["error"]

    error = refusal(unowned)
    assert error["type"] == "not_found_error" and error["param"] == "session_id"
    assert "created without a key" in error["message"]
    assert "belongs to another key" in error["message"]
    assert "admin key" in error["message"]
    for sid in (foreign, "no-such-session"):
        assert refusal(sid) == {**error, "message": error["message"].replace(unowned, sid)}
    anthropic = gw.client.post(f"/s/{unowned}/v1/messages", json=MESSAGE, headers=gw.auth(agent))
    assert anthropic.status_code == 404
    assert anthropic.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": error["message"]},
    }
    assert gw.engine.calls == []
