"""The engine fleet through real parts: real engine processes (tiny model), real Redis, a real
gateway process and the trainer.

- An engine registered mid-run (admin route) serves no request until it has the current
  weights: the gateway keeps it pending while it serves an older version, the trainer's fleet
  watcher pushes it the current weights, and its first request runs on them.
- Removing an engine moves only its sessions.
- A push reaches every engine concurrently: both engines' own log lines show each update
  starting before the other's finished (a sequential push would start the second only after
  the first answered), with each update held open by a running row (`weight_swap = drain`).
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from flywheel.core.auth import KeyStore
from flywheel.core.fleet import Fleet
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.gateway.engines.pool import rendezvous_order
from flywheel.ops.stack import Stack
from flywheel.trainer.service import build_trainer
from flywheel.trainer.weights import WeightPusher

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
UPDATE_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*weights from .* loaded in ([\d.]+) s, "
    r"version (\S+)$"
)


def logged_engine(model_dir: Path, log_path: Path, **env: str) -> AbstractContextManager[str]:
    """`python -m flywheel.engine` with its log in `log_path`; yields its URL."""
    return engine_process(model_dir, log_path=log_path, **env)


def update_spans(log_path: Path) -> list[tuple[float, float, str]]:
    """(start, end, version) of every disk weight update the engine logged, in its own clock:
    the line is written when the swap is done and gives the seconds since the update began."""
    spans = []
    for line in log_path.read_text().splitlines():
        found = UPDATE_LINE.match(line)
        if found:
            stamp, seconds, version = found.groups()
            end = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            spans.append((end - float(seconds), end, version))
    return spans


def metric(url: str, name: str) -> float:
    """The sum of an engine's own Prometheus series `name` (every label set)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name}{{", f"{name} "))
    )


def generated_rows(url: str) -> float:
    """Finished /generate rows of one engine (its own counter; health probes excluded)."""
    return metric(url, "flywheel_engine_requests_total")


def served(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"]


def session_on(engines: list[str], engine: str, tag: str) -> str:
    """A session id whose rendezvous engine among `engines` is `engine`."""
    return next(
        s for s in (f"{tag}-{i}" for i in range(1000)) if rendezvous_order(engines, s)[0] == engine
    )


def test_push_reaches_every_engine_concurrently(tmp_path, tiny_model_dir):
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with (
        logged_engine(tiny_model_dir, logs[0], weight_swap="drain") as a,
        logged_engine(tiny_model_dir, logs[1], weight_swap="drain") as b,
    ):
        # a long row on each engine holds its update open (drain: the swap waits for it)
        body = {
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0},
        }
        rows = [
            threading.Thread(
                target=httpx.post, args=(f"{u}/generate",), kwargs={"json": body, "timeout": 300}
            )
            for u in (a, b)
        ]
        for row in rows:
            row.start()
        deadline = time.monotonic() + 60
        while not all(metric(u, "flywheel_engine_generated_tokens_total") > 0 for u in (a, b)):
            assert time.monotonic() < deadline, "the rows did not start"
            time.sleep(0.02)
        pusher = WeightPusher([a, b], timeout_s=120, attempts=1)
        report = pusher.push(tiny_model_dir, 3)
        pusher.close()
        for row in rows:
            row.join(300)
        assert sorted(report.ok) == sorted([a, b]) and not report.failed
        (start_a, end_a, va), (start_b, end_b, vb) = (update_spans(p)[-1] for p in logs)
        assert va == vb == "3"
        # each engine's update began before the other's was done: both were in flight at once
        assert start_b < end_a and start_a < end_b, (start_a, end_a, start_b, end_b)
        # and each was held by its row (the drain), so the overlap is not an accident of speed
        assert end_a - start_a > 0.05 and end_b - start_b > 0.05


def test_joined_engine_gets_current_weights_before_its_first_request_and_removal_moves_only_its_sessions(  # noqa: E501
    tmp_path, tiny_model_dir, redis_server, prefix
):
    with (
        engine_process(tiny_model_dir) as a,
        engine_process(tiny_model_dir) as b,
    ):
        sections = {
            "redis": {"url": redis_server.url},
            "streams": {"prefix": prefix, "block_ms": 200},
            "engine": {"model_path": str(tiny_model_dir)},
            "gateway": {
                "port": free_port(),
                "engine_urls": [a],
                "default_max_tokens": 4,
                "security": {"auth": "on"},
            },
            "trainer": {
                "model_path": str(tiny_model_dir),
                "port": free_port(),
                "checkpoint": {"dir": str(tmp_path / "ckpt")},
                "logging": {"metrics_path": str(tmp_path / "m.jsonl"), "tensorboard": False},
                "data": {"source": "fake", "fake_prompt_tokens": 4, "fake_completion_tokens": 4},
                "batch": {"group_size": 2, "groups_per_step": 1},
                "optim": {"lr": 1e-2},
                "push": {"attempts": 1, "timeout_s": 60},
            },
            "state_dir": str(tmp_path / "state"),
        }
        # the trainer's watcher is stepped by hand below; the gateway reads the fleet often
        settings = load_settings(**sections, fleet={"refresh_s": 3600})
        gateway_settings = load_settings(**sections, fleet={"refresh_s": 0.3})
        keys = KeyStore(connect(redis_server.url), prefix)
        admin, _ = keys.create("admin", "ops")
        agent, _ = keys.create("agent", "agent")
        trainer = build_trainer(settings)
        with Stack(gateway_settings, echo=lambda _: None, only=("gateway",)) as stack:
            gw = stack.services[0].url
            as_admin = {"Authorization": f"Bearer {admin}"}
            assert trainer.run(max_steps=1) == 1  # the fleet (engine a) serves version 1
            assert served(a) == "1" and served(b) == "default"
            assert Fleet(connect(redis_server.url), prefix, []).version() == 1

            refused = httpx.post(
                f"{gw}/v1/admin/engines",
                json={"url": b},
                headers={"Authorization": f"Bearer {agent}"},
            )
            assert refused.status_code == 403
            nowhere = httpx.post(
                f"{gw}/v1/admin/engines", json={"url": "http://127.0.0.1:9/"}, headers=as_admin
            ).json()
            assert nowhere["url"] == "http://127.0.0.1:9" and nowhere["state"] == "pending"
            assert "does not answer /model_info: it stays pending" in nowhere["detail"]
            gone = httpx.delete(
                f"{gw}/v1/admin/engines", params={"url": "http://127.0.0.1:9"}, headers=as_admin
            )
            assert gone.status_code == 200, gone.text
            bad = httpx.post(f"{gw}/v1/admin/engines", json={"url": "b:1"}, headers=as_admin)
            assert bad.status_code == 400 and "engine URL" in bad.json()["error"]["message"]
            joined = httpx.post(f"{gw}/v1/admin/engines", json={"url": b}, headers=as_admin)
            assert joined.status_code == 200, joined.text
            assert joined.json() == {"url": b, "added": True, "state": "pending"}

            def chat(session: str) -> httpx.Response:
                r = httpx.post(
                    f"{gw}/v1/chat/completions",
                    json={"model": "any", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {agent}", "X-Session-Id": session},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                return r

            on_b = session_on([a, b], b, "s")
            on_a = session_on([a, b], a, "t")
            rows_a = generated_rows(a)
            chat(on_b)  # b is pending: its session is served by a
            assert generated_rows(b) == 0 and generated_rows(a) == rows_a + 1
            listing = httpx.get(f"{gw}/v1/admin/engines", headers=as_admin).json()
            states = {e["url"]: (e["state"], e["weight_version"]) for e in listing["data"]}
            assert listing["weight_version"] == 1
            assert states == {a: ("in_service", 1), b: ("pending", 0)}

            watcher = trainer.parts.pusher.watcher
            assert watcher.check() == {b: None}  # the trainer pushes version 1 to b
            assert served(b) == "1" and generated_rows(b) == 0

            deadline = time.monotonic() + 30
            while states[b][0] != "in_service":
                assert time.monotonic() < deadline, states
                time.sleep(0.2)
                listing = httpx.get(f"{gw}/v1/admin/engines", headers=as_admin).json()
                states = {e["url"]: (e["state"], e["weight_version"]) for e in listing["data"]}
            rows_a = generated_rows(a)
            chat(on_b)  # b's first request, on version 1
            assert generated_rows(b) == 1 and generated_rows(a) == rows_a
            chat(on_a)
            assert generated_rows(b) == 1 and generated_rows(a) == rows_a + 1

            # removing a moves a's sessions to b; b's own sessions stay where they were
            gone = httpx.delete(f"{gw}/v1/admin/engines", params={"url": a}, headers=as_admin)
            assert gone.status_code == 200, gone.text
            missing = httpx.delete(f"{gw}/v1/admin/engines", params={"url": a}, headers=as_admin)
            assert missing.status_code == 404
            rows_a = generated_rows(a)
            chat(on_a)
            chat(on_b)
            assert generated_rows(a) == rows_a and generated_rows(b) == 3
            assert trainer.parts.pusher.engine_urls == [b]  # the trainer sees the same fleet
            _restarted_engine_is_pending_and_the_last_engine_stays(gw, b, as_admin, watcher)
        trainer.close()


def _ready(gw: str) -> tuple[int, str]:
    reply = httpx.get(f"{gw}/readyz", timeout=10)
    return reply.status_code, reply.json()["status"]


def _restarted_engine_is_pending_and_the_last_engine_stays(
    gw: str, b: str, as_admin: dict[str, str], watcher
) -> None:
    """b is the only engine in service (version 1). It comes back on older weights (relabelled
    0, as a restart on the initial weights reports): the gateway takes it out until the
    trainer's watcher pushed it version 1 again, and /readyz is 503 meanwhile. Removing the
    last engine in service is a 409 (OpenAI error JSON) unless forced; then /readyz is 503."""
    assert _ready(gw) == (200, "ready")
    last = httpx.delete(f"{gw}/v1/admin/engines", params={"url": b}, headers=as_admin)
    assert last.status_code == 409, last.text
    error = last.json()["error"]
    assert error["code"] == "last_engine" and "force=true" in error["message"]
    assert _ready(gw) == (200, "ready")

    relabel = httpx.post(
        f"{b}/update_weight_version",
        json={"new_version": "0", "abort_all_requests": False},
        timeout=30,
    )
    assert relabel.status_code == 200, relabel.text
    deadline = time.monotonic() + 30
    while _ready(gw)[0] != 503:
        assert time.monotonic() < deadline, "the engine on older weights stayed in service"
        time.sleep(0.2)
    assert _ready(gw) == (503, "no engine in service")
    listing = httpx.get(f"{gw}/v1/admin/engines", headers=as_admin).json()["data"]
    assert [(e["url"], e["state"], e["weight_version"]) for e in listing] == [(b, "pending", 0)]
    assert watcher.check() == {b: None}  # the trainer pushes the fleet's version 1 again
    assert served(b) == "1"
    while _ready(gw)[0] != 200:
        assert time.monotonic() < deadline, "the engine never came back in service"
        time.sleep(0.2)

    forced = httpx.delete(
        f"{gw}/v1/admin/engines", params={"url": b, "force": "true"}, headers=as_admin
    )
    assert forced.status_code == 200, forced.text
    assert _ready(gw) == (503, "no engine in service")
