"""The distributed pusher against a changing fleet, one component at a time: why a group must be
formed again (`reform_reason`), and the broadcast snapshot kept for engines that join (a
reference to the caller's copy, written once as a folder, dropped once a disk push is newer).
Engines on a mock transport; the group itself is formed through real engines in
tests/integration/test_distributed_fleet.py."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from flywheel.trainer.distributed_push import DistributedPusher, reform_reason
from flywheel.trainer.weights import WeightPusher, WeightsStore


@pytest.mark.parametrize(
    ("new", "reason"),
    [
        ({"a": 1, "b": 1}, None),  # same members, same TP sizes: same rank layout
        ({"a": 1, "b": 1, "c": 2}, "joined"),
        ({"a": 1}, "left"),
        ({"a": 1, "b": 2}, "tp_size"),  # b restarted with --tp-size 2: ranks 1 | 2,3
        ({"a": 2, "c": 1}, "mixed"),  # b left, c joined, a's TP size changed
        ({"b": 1, "c": 1}, "mixed"),  # a left, c joined
    ],
)
def test_reform_reason(new, reason):
    assert reform_reason({"a": 1, "b": 1}, new) == reason


def refusing_engines(tp_size: int = 1) -> httpx.Client:
    """Engines that serve version 0, report `tp_size`, and refuse to join a group."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "0"})
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"tp_size": tp_size, "dp_size": 1})
        return httpx.Response(400, json={"success": False, "message": "no group here"})

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_the_kept_snapshot_is_the_callers_copy_written_once_and_dropped_after_a_disk_push(
    tmp_path, tiny_model_dir
):
    disk = WeightPusher(["http://e1"], timeout_s=5, attempts=1, client=refusing_engines())
    pusher = DistributedPusher(
        disk,
        master_address="127.0.0.1",
        backend="gloo",
        timeout_s=1,  # the rendezvous waits this long for the engine that refused
        joiners=WeightsStore(tmp_path / "joiners", tiny_model_dir),
    )
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert pusher.latest_version() is None and pusher.latest_folder() is None
    assert pusher.broadcast(4, state) is None  # the engine refused the group: disk path
    kept = pusher.latest_snapshot
    assert kept is not None and kept[0] == 4 and kept[1] is state  # no second copy
    assert pusher.latest_version() == 4

    path, version = pusher.latest_folder()  # an engine joined: written once
    assert version == 4 and path == tmp_path / "joiners" / "weights" / "v_00000004"
    assert torch.equal(load_file(path / "model.safetensors")["w"], state["w"])
    assert (path / "config.json").is_file()  # a folder an engine loads
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert pusher.latest_folder() == (path, 4)  # the second joiner reuses it
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert disk.latest == (path, 4)

    newer = tmp_path / "v5"
    newer.mkdir()
    disk.latest = (newer, 5)  # what a disk push of version 5 records
    assert pusher.latest_folder() == (newer, 5)  # the newer folder, nothing written
    assert not (tmp_path / "joiners" / "weights" / "v_00000005").exists()
    pusher.close()


def test_a_disk_push_as_new_as_the_snapshot_drops_it(tmp_path):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "0"})
        return httpx.Response(200, json={"success": True, "message": ""})

    client = httpx.Client(transport=httpx.MockTransport(handle))
    disk = WeightPusher(["http://e1"], timeout_s=5, attempts=1, client=client)
    pusher = DistributedPusher(disk, master_address="127.0.0.1", backend="gloo", timeout_s=5)
    pusher.latest_snapshot = (7, {"w": torch.zeros(2)})
    pusher.push(tmp_path, 6)  # older than the snapshot: it is still the newest weights
    assert pusher.latest_snapshot is not None and pusher.latest_version() == 7
    pusher.push(tmp_path, 7)
    assert pusher.latest_snapshot is None and pusher.latest_version() == 7
    pusher.close()


def test_tp_sizes_map_to_the_configured_engines_and_joiners_are_asked():
    client = refusing_engines(tp_size=4)
    disk = WeightPusher(["http://e1:1/", "http://e2:2"], timeout_s=5, attempts=1, client=client)
    pusher = DistributedPusher(
        disk, master_address="127.0.0.1", backend="gloo", timeout_s=5, tp_sizes=[1, 2]
    )
    # configured URLs in any spelling; a joined engine's /server_info says 4
    assert [pusher.tp_size(u) for u in ("http://e1:1", "http://e2:2", "http://e3:3")] == [1, 2, 4]
    with pytest.raises(ValueError, match="one per engine"):
        DistributedPusher(disk, master_address="x", backend="gloo", timeout_s=5, tp_sizes=[1])
    pusher.close()
