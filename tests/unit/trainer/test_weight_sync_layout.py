"""SGLang's rank layout for TP engines, bucketed broadcasts, the engines' TP sizes from
/server_info, and the background pusher's broadcast-then-disk order (one component each,
engines answered by a mock transport; tests/integration/test_tp_weight_push.py runs the real
processes over gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from flywheel.core.settings import load_settings
from flywheel.trainer.background import BackgroundPusher, snapshot_bytes
from flywheel.trainer.distributed_push import DistributedPusher
from flywheel.trainer.policy import build_pusher
from flywheel.trainer.weight_sync import (
    DistributedWeightSync,
    WeightSyncError,
    buckets,
    rank_layout,
)
from flywheel.trainer.weights import PushReport, WeightPusher


def test_rank_layout_is_one_plus_the_tp_sizes_before():
    # trainer = rank 0; engines of tp 1, 2, 4 take ranks 1 | 2,3 | 4,5,6,7
    assert rank_layout([1, 2, 4]) == ([1, 2, 4], 8)
    # tp 2, 1: offsets 1 and 1+2 = 3; world 1+2+1 = 4
    assert rank_layout([2, 1]) == ([1, 3], 4)
    assert rank_layout([1, 1, 1]) == ([1, 2, 3], 4)  # one rank per engine: 1 + i
    with pytest.raises(ValueError, match="tp_size >= 1"):
        rank_layout([1, 0])


def _t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes // 4, dtype=torch.float32)


def test_buckets_keep_order_and_close_before_overflowing():
    items = [(f"t{i}", _t(n)) for i, n in enumerate([40, 40, 32, 100, 12])]
    sizes = [[t.numel() * 4 for _, t in b] for b in buckets(items, 100)]
    # 40+40 = 80; +32 = 112 > 100 closes it; 32+100 > 100; 100 alone (= the limit); 12
    assert sizes == [[40, 40], [32], [100], [12]]
    names = [n for b in buckets(items, 100) for n, _ in b]
    assert names == ["t0", "t1", "t2", "t3", "t4"]
    assert [len(b) for b in buckets(items, 10**6)] == [5]  # everything fits one bucket
    assert [len(b) for b in buckets(items, 1)] == [1] * 5  # each tensor larger: alone
    with pytest.raises(ValueError):
        buckets(items, 0)


class _Group:
    def __init__(self, log: list) -> None:
        self.log = log

    def broadcast(self, tensor: torch.Tensor, root: int):
        assert root == 0
        self.log.append(("broadcast", None, tensor.numel()))
        return self

    def wait(self) -> None:
        return None


def _recording_client(log: list, replies: dict | None = None) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        log.append((request.url.host, request.url.path, body))
        status, data = (replies or {}).get(
            (request.url.host, request.url.path), (200, {"success": True, "message": "ok"})
        )
        return httpx.Response(status, json=data)

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_init_bodies_follow_the_layout_and_a_wrong_count_is_refused():
    sync = DistributedWeightSync(["http://a", "http://b", "http://c"], tp_sizes=[2, 1, 4])
    assert (sync.rank_offsets, sync.world_size) == ([1, 3, 4], 8)  # 1; 1+2; 1+2+1; 1+7
    assert DistributedWeightSync(["http://a", "http://b"]).world_size == 3  # default tp 1 each
    with pytest.raises(ValueError, match="one per engine"):
        DistributedWeightSync(["http://a", "http://b"], tp_sizes=[2])


def test_push_sends_one_call_per_bucket_and_the_version_with_the_last():
    log: list = []
    sync = DistributedWeightSync(["http://a", "http://b"], tp_sizes=[1, 2], bucket_bytes=100)
    sync._http = _recording_client(log)
    sync._group = _Group(log)
    embed = _t(40).reshape(2, 5)
    named = [
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: sent once
        ("model.norm.weight", _t(40)),
        ("model.layers.0.mlp.up_proj.weight", _t(80)),
    ]
    assert sync.push(named, weight_version="9") == 3
    # buckets: [embed 40 + norm 40 = 80], [up_proj 80]
    updates = [b for _, p, b in log if p == "/update_weights_from_distributed"]
    assert [u["names"] for u in updates] == [
        ["model.embed_tokens.weight", "model.norm.weight"],
        ["model.embed_tokens.weight", "model.norm.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
    ]
    assert [u["shapes"] for u in updates[::2]] == [[[2, 5], [10]], [[20]]]
    assert [u.get("weight_version") for u in updates] == [None, None, "9", "9"]
    assert [u["flush_cache"] for u in updates] == [False, False, True, True]
    assert all(u["abort_all_requests"] is False for u in updates)
    # per engine: begin, the buckets, end; each bucket's broadcasts in its names' order
    for host in ("a", "b"):
        paths = [p for h, p, _ in log if h == host]
        assert paths == [
            "/begin_weight_update",
            "/update_weights_from_distributed",
            "/update_weights_from_distributed",
            "/end_weight_update",
        ]
    assert [x for x in log if x[0] == "broadcast"] == [
        ("broadcast", None, 10),
        ("broadcast", None, 10),
        ("broadcast", None, 20),
    ]


def test_a_refused_bucket_stops_the_push_and_still_ends_the_session():
    log: list = []
    refuse = {("b", "/update_weights_from_distributed"): (400, {"success": False, "message": "x"})}
    sync = DistributedWeightSync(["http://a", "http://b"], bucket_bytes=40)
    sync._http = _recording_client(log, refuse)
    sync._group = _Group(log)
    with pytest.raises(WeightSyncError, match="http://b/update_weights_from_distributed"):
        sync.push([("w1", _t(40)), ("w2", _t(40))], weight_version="3")
    assert [x for x in log if x[0] == "broadcast"] == [("broadcast", None, 10)]  # not bucket 2
    assert [h for h, p, _ in log if p == "/end_weight_update"] == ["a", "b"]


def _pusher(replies: dict, log: list, **kwargs) -> DistributedPusher:
    disk = WeightPusher(
        ["http://a", "http://b"], timeout_s=5, attempts=1, client=_recording_client(log, replies)
    )
    return DistributedPusher(
        disk, master_address="127.0.0.1", backend="gloo", timeout_s=5, **kwargs
    )


def test_tp_sizes_come_from_server_info_with_the_old_route_as_fallback():
    log: list = []
    replies = {
        ("a", "/server_info"): (200, {"tp_size": 2, "dp_size": 1}),
        ("b", "/server_info"): (404, {"detail": "Not Found"}),  # SGLang < 0.5.12
        ("b", "/get_server_info"): (200, {"tp_size": 4}),
    }
    pusher = _pusher(replies, log)
    assert [pusher.server_tp_size(u) for u in pusher.engine_urls] == [2, 4]

    silent = _pusher({("a", "/server_info"): (200, {"model_path": "m"})}, log)
    with pytest.raises(WeightSyncError, match="trainer.push.tp_sizes"):
        silent.server_tp_size("http://a")
    dp = _pusher({("a", "/server_info"): (200, {"tp_size": 1, "dp_size": 2})}, log)
    with pytest.raises(WeightSyncError, match="dp_size 2"):
        dp.server_tp_size("http://a")


def test_an_engine_ahead_sends_the_push_by_disk():
    log: list = []
    replies = {("b", "/model_info"): (200, {"weight_version": "5"})}
    pusher = _pusher(replies, log, tp_sizes=[1, 1])
    # b serves 5 >= 4: no group is formed, the disk path (which skips b) takes version 4
    assert pusher.broadcast(4, {"w": torch.ones(2)}) is None
    assert pusher.sync is None
    assert not [p for _, p, _ in log if p == "/init_weights_update_group"]


def test_tp_sizes_setting_must_name_every_engine(tmp_path):
    settings = load_settings(
        trainer={
            "push": {
                "mode": "distributed",
                "engine_urls": ["http://a:30000", "http://b:30000"],
                "tp_sizes": [2],
            }
        }
    )
    with pytest.raises(ValueError, match="tp_sizes has 1 entries for 2 engines"):
        build_pusher(settings)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        load_settings(trainer={"push": {"tp_sizes": [1, 0]}})


def test_background_pusher_broadcasts_first_and_writes_only_for_the_disk_path(tmp_path):
    calls: list[str] = []
    snapshot = {"a": torch.ones(4), "b": torch.ones(2, dtype=torch.float64)}
    snapshot["tied"] = snapshot["a"]

    def write(version: int, state: dict) -> Path:
        calls.append(f"write {version}")
        (tmp_path / "w.bin").write_bytes(b"x" * 10)
        return tmp_path

    def push(path: Path, version: int) -> PushReport:
        calls.append(f"disk {version}")
        return PushReport(version, ["e"], {}, 0.0)

    def broadcast(version: int, state: dict) -> PushReport | None:
        calls.append(f"broadcast {version}")
        return PushReport(version, ["e"], {}, 0.0, via="distributed") if version != 2 else None

    pusher = BackgroundPusher(write, push, enabled=False, broadcast=broadcast)
    pusher.offer(1, snapshot)
    pusher.offer(2, snapshot)  # the broadcast cannot: written and pushed by disk
    assert calls == ["broadcast 1", "broadcast 2", "write 2", "disk 2"]
    first, second = pusher.results()
    # distinct tensors only: a (4 x 4 bytes) + b (2 x 8 bytes) = 32 bytes; tied counted once
    assert (first.bytes, first.path, first.report.via) == (32, None, "distributed")
    assert snapshot_bytes(snapshot) == 32
    assert (second.bytes, second.path, second.report.via) == (10, tmp_path, "disk")
