"""The distributed push pauses every engine in the mode `trainer.push.pause` names around the
broadcast and always continues them; engines on a mock transport record the calls."""

from __future__ import annotations

import json

import httpx
import pytest

from flywheel.trainer.distributed_push import DistributedPusher
from flywheel.trainer.weights import WeightPusher


@pytest.mark.parametrize("mode", ["none", "in_place", "abort"])
def test_the_broadcast_is_paused_in_its_mode_and_continued(mode):
    calls: list[tuple[str, str, dict]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.host, request.url.path, json.loads(request.content or b"{}")))
        return httpx.Response(200, json={"status": "ok"})

    client = httpx.Client(transport=httpx.MockTransport(handle))
    disk = WeightPusher(["http://e1", "http://e2"], timeout_s=5, attempts=1, client=client)
    pusher = DistributedPusher(
        disk, master_address="127.0.0.1", backend="gloo", timeout_s=5, pause=mode
    )
    with pusher._paused():
        calls.append(("trainer", "broadcast", {}))
    if mode == "none":
        assert calls == [("trainer", "broadcast", {})]
        return
    assert calls == [
        ("e1", "/pause_generation", {"mode": mode}),
        ("e2", "/pause_generation", {"mode": mode}),
        ("trainer", "broadcast", {}),
        ("e1", "/continue_generation", {}),
        ("e2", "/continue_generation", {}),
    ]
