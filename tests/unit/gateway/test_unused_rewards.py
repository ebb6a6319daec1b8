"""A reward that reaches no Sample is never dropped without a word: an episode finished with no
turn answers why (`rewards_unused`), logs a warning and counts each reward in
`flywheel_gateway_rewards_unused_total{reason="no_turns"}` (fake engine, real Redis)."""

import logging

from flywheel.gateway.session.finish import REWARDS_UNUSED

from .test_app import _chat, env, renderer  # noqa: F401  (fixtures)


def _unused() -> float:
    return REWARDS_UNUSED.labels("no_turns")._value.get()


def test_rewards_of_a_session_without_turns_are_reported_logged_and_counted(env, caplog):
    client, _, redis_client, prefix = env
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    assert client.post(f"/v1/sessions/{sid}/reward", json={"reward": 0.5, "name": "env"}).is_success
    before = _unused()
    with caplog.at_level(logging.WARNING, logger="flywheel.gateway.session.finish"):
        done = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).json()
    assert done["samples_published"] == 0
    assert done["rewards_unused"]["reason"] == "no_turns"
    assert done["rewards_unused"]["names"] == ["env", "outcome"]
    assert _unused() == before + 2  # two rewards (env, outcome), one count each
    assert any(sid in r.getMessage() and "no turn" in r.getMessage() for r in caplog.records)
    assert redis_client.xlen(f"{prefix}:rollouts") == 0


def test_a_session_with_a_turn_or_without_rewards_reports_nothing_unused(env):
    client, _, _, _ = env
    before = _unused()
    empty = client.post("/v1/sessions", json={}).json()["session_id"]
    assert "rewards_unused" not in client.post(f"/v1/sessions/{empty}/finish", json={}).json()
    created = client.post("/v1/sessions", json={}).json()
    base = created["base_url"].removeprefix("http://testserver")
    assert _chat(client, base).status_code == 200
    done = client.post(f"/v1/sessions/{created['session_id']}/finish", json={"reward": 1.0})
    assert done.json()["samples_published"] == 1 and "rewards_unused" not in done.json()
    assert _unused() == before
