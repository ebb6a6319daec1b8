"""Redis killed (SIGKILL) and restarted on its append-only file: nothing acked or unacked is lost,
acked entries are not redelivered, and the gateway answers 503 (not 500) while Redis is down."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import redis

from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import LocalRedis
from flywheel.core.streams import FIELD, StreamConsumer, StreamProducer

CHAT = {"model": "m", "max_tokens": 8}


def _sample(i: int):
    return new_sample(
        token_ids=[i, i + 1],
        loss_mask=[0, 1],
        rollout_logprobs=[0.0, -0.1],
        weight_versions=[-1, 0],
        group_id=f"g{i}",
    )


@pytest.fixture
def own_redis(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def _kill(server: LocalRedis) -> None:
    """SIGKILL (no shutdown handler, no final AOF rewrite) once Redis has handed what it
    acknowledged to the OS: with `appendfsync everysec` it holds its append-only-file writes
    back for up to 2 s while a slow fsync runs (a loaded disk), and a SIGKILL then loses those,
    as Redis documents for that policy."""
    client, deadline = connect(server.url), time.monotonic() + 10
    while client.info("persistence")["aof_buffer_length"] and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.kill()
    server.proc.wait()


def _crash_and_restart(server: LocalRedis) -> None:
    _kill(server)
    server.start()


def test_stream_survives_sigkill_with_acks_and_pending_intact(own_redis, prefix):
    client = connect(own_redis.url)
    stream = f"{prefix}:train"
    producer = StreamProducer(client, stream)
    consumer = StreamConsumer(
        client, stream, "trainer", "c1", dead_stream=f"{prefix}:dead", min_idle_ms=0
    )
    ids = [producer.publish(_sample(i)) for i in range(20)]  # every XADD was acknowledged
    read = consumer.read(count=12, block_ms=10)
    acked, pending = [e.entry_id for e in read[:8]], [e.entry_id for e in read[8:]]
    assert consumer.ack(acked) == 8

    _crash_and_restart(own_redis)

    assert [i.decode() for i, _ in client.xrange(stream)] == ids  # nothing acked-by-Redis lost
    info = client.xpending(stream, "trainer")
    assert info["pending"] == 4  # unacked deliveries still pending, owned by c1
    survivor = StreamConsumer(
        client, stream, "trainer", "c2", dead_stream=f"{prefix}:dead", min_idle_ms=0
    )
    got = []
    for _ in range(4):
        batch = survivor.read(count=5, block_ms=10)
        got += [e.entry_id for e in batch]
        survivor.ack([e.entry_id for e in batch])
    assert sorted(got) == sorted(pending + ids[12:])  # the 8 acked ones never come back
    assert [decode_sample(f[FIELD]).group_id for _, f in client.xrange(stream)] == [
        f"g{i}" for i in range(20)
    ]


def test_gateway_answers_503_while_redis_is_down_and_loses_no_turn(
    own_redis, procs, inproc_gateway, prefix
):
    client = connect(own_redis.url)
    gw = inproc_gateway([procs.stub("ok")], client=client)
    msgs = [{"role": "user", "content": "What is 7 + 1?"}]
    with httpx.Client(base_url=gw, timeout=30) as http:
        sid = http.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
        first = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert first.status_code == 200
        msgs += [first.json()["choices"][0]["message"], {"role": "user", "content": "Sure?"}]

        _kill(own_redis)
        down = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert down.status_code == 503, down.text
        assert (
            down.headers["retry-after"]
            and down.json()["error"]["type"] == "service_unavailable_error"
        )
        assert http.get("/readyz").status_code == 503
        own_redis.start()

        second = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert second.status_code == 200, second.text
        assert http.post(f"/v1/sessions/{sid}/finish", json={}).json()["samples_published"] == 1
    ((_, fields),) = client.xrange(f"{prefix}:rollouts")
    sample = decode_sample(fields[FIELD])
    assert sum(sample.loss_mask) == 4  # both turns' sampled tokens (2 each), recorded once


def test_client_gives_up_within_bounds_while_redis_is_down(own_redis):
    client = connect(own_redis.url)
    own_redis.proc.kill()
    own_redis.proc.wait()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_requests_whose_authentication_needs_redis_get_503_while_it_is_down(
    own_redis, procs, inproc_gateway
):
    """With no cached answer to "are API keys required?" every request asks Redis in the
    security middleware: while Redis is down that is a 503 too (was a bare 500)."""
    client = connect(own_redis.url)
    gw = inproc_gateway([procs.stub("ok")], client=client, security={"key_cache_s": 0})
    own_redis.proc.kill()
    own_redis.proc.wait()
    with httpx.Client(base_url=gw, timeout=30) as http:
        ready = http.get("/readyz")
        chat = http.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi"}]}
        )
        alive = http.get("/healthz")  # liveness needs no Redis: no restart for an outage
    for answer in (ready, chat):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "service_unavailable_error"
    assert alive.status_code == 200 and alive.json()["status"] == "ok"


def test_a_hung_redis_fails_requests_after_the_reply_timeout_not_minutes(
    own_redis, procs, inproc_gateway, prefix
):
    """A Redis that stops answering (SIGSTOP: the socket stays open, nothing replies) fails a
    chat turn with a 503 once `gateway.redis_timeout_s` passes, without retrying the timed-out
    command. The lock script it sent still reaches Redis when Redis resumes: past its deadline
    it does nothing, so the client's retry is served at once (it used to lock the session for a
    request that was gone, and the retry waited out the 15 s lease)."""
    timeout_s = 1.0
    client = connect(own_redis.url, socket_timeout=timeout_s)
    gw = inproc_gateway([procs.stub("ok")], client=client)
    msgs = [{"role": "user", "content": "What is 7 + 1?"}]
    with httpx.Client(base_url=gw, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
        first = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        msgs += [first.json()["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
        own_redis.proc.send_signal(signal.SIGSTOP)  # the next turn's lock script hangs
        try:
            started = time.monotonic()
            hung = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
            waited = time.monotonic() - started
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        assert hung.status_code == 503, hung.text
        assert hung.json()["error"]["type"] == "service_unavailable_error"
        # one reply timeout (1 s), not 4 (3 retries) and not the TCP stack's minutes
        assert timeout_s <= waited < 3 * timeout_s, waited
        time.sleep(0.3)  # Redis runs what it was sent while stopped
        assert connect(own_redis.url).pttl(f"{prefix}:session-lock:{sid}") == -2
        started = time.monotonic()
        retry = http.post(f"/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert retry.status_code == 200 and time.monotonic() - started < 1.0, retry.text


def test_a_save_that_reaches_a_stalled_redis_late_is_not_applied(
    own_redis, procs, inproc_gateway, prefix
):
    """Redis stalls while the engine answers (a slow stub, 3 s): the turn's save waits past
    the reply timeout and the client gets a 503. When Redis resumes the save is past its
    deadline and only releases the lock: nothing is recorded or published, so the client's
    retry is the one turn recorded (it used to be saved anyway and recorded twice)."""
    client = connect(own_redis.url, socket_timeout=1.0)
    slow = inproc_gateway([procs.stub("slow")], client=client)
    ok = inproc_gateway([procs.stub("ok")], client=client)
    msgs = [{"role": "user", "content": "What is 7 + 1?"}]
    with httpx.Client(timeout=60) as http:
        sid = http.post(f"{ok}/v1/sessions", json={"group_id": "g"}).json()["session_id"]
        first = http.post(f"{ok}/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        msgs += [first.json()["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
        box = {}
        turn = threading.Thread(
            target=lambda: box.update(
                r=http.post(f"{slow}/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
            )
        )
        turn.start()
        time.sleep(1.5)  # the engine call is in flight
        own_redis.proc.send_signal(signal.SIGSTOP)
        turn.join(30)
        own_redis.proc.send_signal(signal.SIGCONT)
        assert box["r"].status_code == 503, box["r"].text
        time.sleep(0.3)  # Redis runs the late save now
        assert connect(own_redis.url).xlen(f"{prefix}:rollouts") == 0
        retry = http.post(f"{ok}/s/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert retry.status_code == 200, retry.text
        done = http.post(f"{ok}/v1/sessions/{sid}/finish", json={}).json()
        info = http.get(f"{ok}/v1/sessions/{sid}").json()
    assert done["samples_published"] == 1 and info["turns"] == 2 and info["forks"] == 0
    ((_, fields),) = connect(own_redis.url).xrange(f"{prefix}:rollouts")
    assert sum(decode_sample(fields[FIELD]).loss_mask) == 4  # two turns of 2 sampled tokens
