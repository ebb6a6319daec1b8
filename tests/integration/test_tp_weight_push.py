"""The distributed weight push with SGLang's rank layout for TP engines, over gloo between real
processes: two embedded engines (`python -m flywheel.engine`, tiny model), one of them joining
the group as two ranks (`engine.emulate_tp_size = 2`, reported as `tp_size` by /server_info).

- After a bucketed broadcast both engines serve exactly (bit for bit) what a disk push of the
  same state serves: the same greedy logprobs and the same tensors.
- An engine applies a session's buckets once, at /end_weight_update: between buckets it still
  serves the old weights.
- Under the trainer the broadcast of step k runs in the background while step k+1 trains, and
  one push never overlaps the next (shown by the timeline's timestamps, no timing thresholds).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.trainer.distributed_push import DistributedPusher
from flywheel.trainer.service import build_trainer
from flywheel.trainer.snapshots import cpu_snapshot
from flywheel.trainer.weight_sync import DistributedWeightSync
from flywheel.trainer.weights import WeightPusher, WeightsStore, unique_storage

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [1, 504, 3458, 314, 260, 1789, 28, 29, 30]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(an engine of one rank, an engine of two ranks)."""
    with (
        engine_process(tiny_model_dir, context_length="256") as one,
        engine_process(tiny_model_dir, context_length="256", emulate_tp_size="2") as two,
    ):
        yield one, two


def served_tensors(url: str, names: list[str]) -> dict[str, list]:
    """Each named parameter as served (float32 lists; the embedding's first 4 rows)."""
    out = {}
    for name in names:
        rows = 4 if "embed_tokens" in name else 10**6
        r = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": rows})
        assert r.status_code == 200, r.text
        out[name] = r.json()
    return out


def behaviour(url: str) -> tuple[list, list, str]:
    """(prompt logprobs, greedy completion logprobs and ids, weight version) as served."""
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    return meta["input_token_logprobs"], meta["output_token_logprobs"], meta["weight_version"]


def perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    state = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_bucketed_tp_push_serves_what_a_disk_push_serves(engines, tiny_model_dir, tmp_path):
    one, two = engines
    infos = [httpx.get(f"{u}/server_info").json() for u in engines]
    assert [i["tp_size"] for i in infos] == [1, 2]
    state = cpu_snapshot(perturbed(tiny_model_dir, seed=3))
    names = sorted(state)
    before = behaviour(one)
    assert behaviour(two)[:2] == before[:2]  # same initial weights

    disk = WeightPusher([one, two], timeout_s=60, attempts=1)
    pusher = DistributedPusher(
        disk, master_address="127.0.0.1", backend="gloo", timeout_s=60, bucket_bytes=64 * 1024
    )
    try:
        report = pusher.broadcast(1, state)
        assert report is not None and report.via == "distributed"
        sync = pusher.sync
        assert sync is not None
        # tp sizes asked from /server_info: offsets 1 and 1+1 = 2, world 1+1+2 = 4
        assert (sync.tp_sizes, sync.rank_offsets, sync.world_size) == ([1, 2], [1, 2], 4)
        dist = [behaviour(u) for u in engines]
        dist_tensors = [served_tensors(u, names) for u in engines]
        assert [d[2] for d in dist] == ["1", "1"]
        assert dist[0][:2] != before[:2]  # the weights changed
        assert dist[1][:2] == dist[0][:2]
        assert dist_tensors[1] == dist_tensors[0]

        folder = WeightsStore(tmp_path, tiny_model_dir).write(2, state)
        assert pusher.push(folder, 2).via == "disk"
        from_disk = [behaviour(u) for u in engines]
        assert [d[2] for d in from_disk] == ["2", "2"]
        for d, f in zip(dist, from_disk, strict=True):
            assert f[:2] == d[:2]  # bit for bit: JSON floats compared exactly
        for u, t in zip(engines, dist_tensors, strict=True):
            assert served_tensors(u, names) == t
    finally:
        pusher.close()


def test_buckets_of_a_session_are_applied_once_at_its_end(engines, tiny_model_dir):
    _, two = engines
    name = "model.norm.weight"
    old = served_tensors(two, [name])[name]
    sync = DistributedWeightSync([two], tp_sizes=[2], backend="gloo", timeout_s=60)
    sync.connect()
    try:
        for path in ("/begin_weight_update",):
            assert httpx.post(f"{two}{path}", json={}).json()["success"] is True
        try:
            new = torch.full((64,), 0.5)
            sync._send_bucket([(name, new)], "b-1", flush_cache=True, abort_all_requests=False)
            assert served_tensors(two, [name])[name] == old  # received, not yet applied
            assert behaviour(two)[2] != "b-1"
        finally:
            assert httpx.post(f"{two}/end_weight_update", json={}).json()["success"] is True
        assert served_tensors(two, [name])[name] == [0.5] * 64
        assert behaviour(two)[2] == "b-1"
    finally:
        sync.close()


def test_trainer_broadcasts_step_k_while_step_k_plus_1_trains(engines, tiny_model_dir, tmp_path):
    one, two = engines
    for url in engines:  # earlier tests pushed versions 1 and 2: start this run below them
        r = httpx.post(f"{url}/update_weight_version", json={"new_version": "0"}, timeout=30)
        assert r.status_code == 200, r.text
    metrics = tmp_path / "m.jsonl"
    settings = load_settings(
        trainer={
            "model_path": str(tiny_model_dir),
            "port": free_port(),
            "precision": "fp32",
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 3},
            "logging": {"metrics_path": str(metrics), "tensorboard": False},
            "data": {"source": "fake", "fake_prompt_tokens": 4, "fake_completion_tokens": 4},
            "batch": {"group_size": 2, "groups_per_step": 1},
            "optim": {"lr": 1e-2},
            "push": {
                "engine_urls": [one, two],
                "mode": "distributed",
                "attempts": 1,
                "timeout_s": 60,
                "bucket_mb": 0.25,
            },
        }
    )
    trainer = build_trainer(settings)
    assert trainer.pusher.enabled  # background_io: the broadcast is off the critical path
    broadcast = trainer.pusher.broadcast
    assert broadcast is not None

    def lines() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    def gated(version: int, state: dict) -> object:
        # step 1's broadcast starts only once step 2 has trained (its metrics line exists): it
        # can, because it reads the CPU snapshot of step 1, not the live model
        deadline = time.monotonic() + 30
        while version == 1 and lines() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return broadcast(version, state)

    trainer.pusher.broadcast = gated
    stop = threading.Event()
    timer = threading.Timer(240, stop.set)
    timer.start()
    try:
        assert trainer.run(stop, max_steps=3) == 3
    finally:
        timer.cancel()
        trainer.close()
    assert trainer.last_push_via == "distributed"

    events = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    span = {(e["stage"], e["step"]): (e["start"], e["end"]) for e in events}
    push1, train2 = span[("push", 1)], span[("train", 2)]
    assert push1[0] < train2[1]  # began before step 2 ended (offered when step 1 committed)
    assert push1[1] > train2[1]  # and ended after step 2 had trained: they overlapped
    pushes = sorted(v for (stage, _), v in span.items() if stage == "push")
    for (_, end), (start, _) in zip(pushes, pushes[1:], strict=False):
        assert start >= end  # a push never overlaps the previous one
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0].get("push_version") is None  # step 1's push had not ended at row 1
    state = load_file(tmp_path / "ckpt" / "step_00000003" / "model.safetensors")
    nbytes = sum(t.numel() * t.element_size() for t in unique_storage(state).values())
    # pushes that ended after the last row are held for the next row: the final one is there
    held = [trainer._io_metrics] if "push_version" in trainer._io_metrics else []
    reported = [r for r in rows if r.get("push_version") is not None] + held
    assert reported and reported[-1]["push_version"] == 3, reported
    for row in reported:
        assert row["push_bytes"] == nbytes  # broadcast: the distinct fp32 tensors
        assert row["push/write_s"] == 0.0  # nothing written for the disk path

    names = sorted(state)
    for url in engines:
        assert behaviour(url)[2] == "3"
        served = served_tensors(url, names)
        for name in names:
            rows_ = 4 if "embed_tokens" in name else None
            assert served[name] == state[name][:rows_].tolist(), (url, name)


def test_a_group_left_by_a_dead_trainer_is_formed_again(engines, tiny_model_dir):
    """A trainer that died mid-push leaves the group (its name taken) and an open session with
    received tensors on the engines. The next trainer destroys the left-over group before it
    forms its own, which drops the stale session unapplied, and its first push broadcasts."""
    one, two = engines
    dead = DistributedWeightSync([one, two], tp_sizes=[1, 2], backend="gloo", timeout_s=60)
    dead.connect()
    for url in engines:
        assert httpx.post(f"{url}/begin_weight_update", json={}).json()["success"] is True
    stale = torch.full((64,), 7.0)
    dead._send_bucket(
        [("model.norm.weight", stale)], "99", flush_cache=True, abort_all_requests=False
    )
    # the trainer dies here: no end, no destroy

    for url in engines:  # below the versions the earlier tests pushed
        httpx.post(f"{url}/update_weight_version", json={"new_version": "0"}, timeout=30)
    state = cpu_snapshot(perturbed(tiny_model_dir, seed=4))
    pusher = DistributedPusher(
        WeightPusher([one, two], timeout_s=60, attempts=1),
        master_address="127.0.0.1",
        backend="gloo",
        timeout_s=60,
    )
    try:
        report = pusher.broadcast(5, state)
        assert report is not None and report.via == "distributed"
    finally:
        pusher.close()
    for url in engines:
        assert behaviour(url)[2] == "5"
        norm = served_tensors(url, ["model.norm.weight"])["model.norm.weight"]
        assert norm == state["model.norm.weight"].tolist() != stale.tolist()
