"""Kill -9 the gateway process during a load and start a new one on the same port: sessions
live in Redis, so episodes begun before the crash finish after it with every turn recorded, and
the Samples in the stream are exactly the ones the finish calls reported (none lost, none twice).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx

from flywheel.core.codec import decode_sample
from flywheel.core.redis_server import free_port
from flywheel.core.streams import FIELD
from flywheel.gateway.session.store import SessionStore

CHAT = {"model": "m", "max_tokens": 8}


def _retrying(http: httpx.Client, method: str, path: str, deadline: float, **kw):
    """The request, retried on connection errors (gateway down) until `deadline`."""
    while True:
        try:
            return http.request(method, path, **kw)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _episode(http: httpx.Client, deadline: float, pause=None) -> tuple[str, int]:
    """create -> turn -> (pause) -> turn -> finish; returns (session id, Samples reported)."""
    sid = _retrying(http, "POST", "/v1/sessions", deadline, json={"group_id": "g"}).json()[
        "session_id"
    ]
    msgs = [{"role": "user", "content": "7 + 1?"}]
    for turn in range(2):
        if turn == 1 and pause is not None:
            pause()
        reply = _retrying(
            http, "POST", f"/s/{sid}/v1/chat/completions", deadline, json={**CHAT, "messages": msgs}
        )
        assert reply.status_code == 200, reply.text
        msgs += [reply.json()["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
    done = _retrying(http, "POST", f"/v1/sessions/{sid}/finish", deadline, json={})
    assert done.status_code == 200, done.text
    return sid, done.json()["samples_published"]


def test_sessions_survive_a_gateway_crash_under_load(
    procs, redis_server, redis_client, prefix, tiny_model_dir
):
    stub, port = procs.stub("ok"), free_port()
    gw = procs.gateway(redis_server.url, prefix, [stub], tiny_model_dir, port=port)
    first = procs.procs[-1]
    deadline = time.monotonic() + 150
    reported: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    crashed, restarted = threading.Event(), threading.Event()

    def agent() -> None:
        with httpx.Client(base_url=gw, timeout=30) as http:
            try:
                while not stop.is_set():
                    reported.append(_episode(http, deadline))
            except BaseException as exc:  # noqa: BLE001  (re-raised in the test thread)
                errors.append(exc)

    agents = [threading.Thread(target=agent) for _ in range(3)]
    for t in agents:
        t.start()
    with httpx.Client(base_url=gw, timeout=30) as http:
        # one episode deterministically spans the crash: turn 1 before, turn 2 after
        def crash_and_restart() -> None:
            procs.kill(first)
            crashed.set()
            procs.gateway(redis_server.url, prefix, [stub], tiny_model_dir, port=port)
            restarted.set()

        spanning, published = _episode(http, deadline, pause=crash_and_restart)
        time.sleep(1.0)  # the load keeps running on the new process
    stop.set()
    for t in agents:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in agents), "an agent is stuck (a lock left by the crash?)"
    assert not errors, errors
    assert crashed.is_set() and restarted.is_set()
    samples = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]
    assert len({s.sample_id for s in samples}) == len(samples)  # none twice
    # Per session, the stream holds exactly the Samples its record counts as published: at
    # finish, plus any segment closed by a fork (a turn re-sent after the crash that no longer
    # extends the recorded history is a new segment, as the recording rule says).
    store = SessionStore(redis_client, prefix, 60)
    by_session = Counter(s.session_id for s in samples)
    for sid, at_finish in [*reported, (spanning, published)]:
        record = store.get(sid)
        assert record.status == "finished"
        assert by_session[sid] == record.samples_published >= at_finish, sid
    assert set(by_session) == {sid for sid, _ in reported} | {spanning}  # no stray Samples
    # the episode that spans the crash is one Sample with both turns' sampled tokens (2 + 2)
    (episode,) = [s for s in samples if s.session_id == spanning]
    assert sum(episode.loss_mask) == 4
    assert len(reported) >= 3
