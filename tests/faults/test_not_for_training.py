"""A key marked not for training, through a real Redis, an in-process gateway (real HTTP) and a
stub engine process whose `/stats` counts `/generate` calls: its requests are served (the engine
answers them), nothing reaches the stream or a session, and each turn is counted. A key for
training on the same stack records (the control); marking it not for training stops that."""

from __future__ import annotations

import httpx
from prometheus_client import REGISTRY

from flywheel.core.auth import KeyStore


def _unrecorded() -> float:
    value = REGISTRY.get_sample_value(
        "flywheel_gateway_live_turns_unrecorded_total", {"reason": "not_for_training"}
    )
    return value or 0.0


def _conversation(http: httpx.Client, key: str, sid: str, turns: int) -> None:
    """`turns` chat turns of one conversation in the live session `X-Session-Id: sid`."""
    history: list[dict] = []
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": sid}
    for i in range(turns):
        history.append({"role": "user", "content": f"question {i}"})
        body = {"model": "m", "max_tokens": 4, "messages": history}
        resp = http.post("/v1/chat/completions", headers=headers, json=body)
        assert resp.status_code == 200, resp.text
        history.append(resp.json()["choices"][0]["message"])


def test_not_for_training_key_is_served_and_never_recorded(
    procs, inproc_gateway, redis_client, prefix
):
    keys = KeyStore(redis_client, prefix)
    private, private_rec = keys.create("agent", "private", train=False)
    trained, trained_rec = keys.create("agent", "trained")
    admin, _ = keys.create("admin", "ops")
    engine = procs.stub("ok")
    gw = inproc_gateway([engine], security={"key_cache_s": 0})
    rollouts = f"{prefix}:rollouts"
    as_admin = {"Authorization": f"Bearer {admin}"}
    with httpx.Client(base_url=gw, timeout=30) as http:
        counted = _unrecorded()
        _conversation(http, private, "nt-chat", 3)
        assert procs.calls(engine) == 3  # served by the engine ...
        assert redis_client.exists(rollouts) == 0  # ... nothing in the stream
        assert http.get("/v1/sessions/nt-chat", headers=as_admin).status_code == 404
        assert _unrecorded() == counted + 3

        msg = http.post(
            "/v1/messages",
            headers={"x-api-key": private, "X-Session-Id": "nt-messages"},
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert msg.status_code == 200, msg.text
        assert msg.json()["type"] == "message"
        assert _unrecorded() == counted + 4
        assert http.get("/v1/sessions/nt-messages", headers=as_admin).status_code == 404

        refused = http.post("/v1/sessions", headers={"Authorization": f"Bearer {private}"}, json={})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "not_for_training"

        # the control: a key for training on the same stack records its turns
        _conversation(http, trained, "t-chat", 2)  # turn 2 publishes turn 1
        assert redis_client.xlen(rollouts) == 1
        assert http.get("/v1/sessions/t-chat", headers=as_admin).json()["turns"] == 2

        # marked not for training by an admin: its next conversation is not recorded
        marked = http.patch(
            f"/v1/admin/keys/{trained_rec.key_id}", headers=as_admin, json={"train": False}
        )
        assert marked.status_code == 200 and marked.json()["train"] is False
        _conversation(http, trained, "t-chat-2", 2)
        assert redis_client.xlen(rollouts) == 1
        assert http.get("/v1/sessions/t-chat-2", headers=as_admin).status_code == 404
        assert _unrecorded() == counted + 6
        assert private_rec.train is False
