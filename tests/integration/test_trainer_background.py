"""Checkpoints and weight pushes off the step's critical path, shown by timestamps: with
`background_io` the push and the checkpoint of step 1 are still running while step 2 trains;
without it they end before step 2 starts. And one push reaches two real engines at once, never
giving either an older version."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from flywheel.trainer.service import build_trainer
from flywheel.trainer.weights import WeightPusher, WeightsStore, load_model

from ..engine_process import engine_process
from .push_target import PushTarget
from .test_trainer_service import (  # noqa: F401  (module fixture)
    make_group,
    model_dir,
    publish,
    run_steps,
    trainer_settings,
)

pytestmark = pytest.mark.integration


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


class GatedEngine(PushTarget):
    """Answers a push of version 1 only once `ready()` is true (or after `limit_s`)."""

    def __init__(self, ready, limit_s: float):
        self.ready, self.limit_s = ready, limit_s
        super().__init__()

    def on_push(self, path: str, body: dict) -> tuple[int, dict]:
        if body["weight_version"] == "1":
            deadline = time.monotonic() + self.limit_s
            while not self.ready() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().on_push(path, body)


@pytest.mark.parametrize("background", [True, False], ids=["background", "critical_path"])
def test_push_and_checkpoint_of_a_step_overlap_the_next_step(
    tmp_path,
    redis_server,
    prefix,
    model_dir,  # noqa: F811
    background,
):
    metrics = tmp_path / "metrics.jsonl"
    # step 1's push and checkpoint finish only once step 2 is trained (its metrics line exists);
    # on the critical path they cannot, so they give up waiting after 3 s
    engine = GatedEngine(lambda: _lines(metrics) >= 2, limit_s=3.0)
    try:
        settings = trainer_settings(
            tmp_path,
            redis_server,
            prefix,
            engine.url,
            model_dir=model_dir,
            checkpoint={"every": 1},
            background_io=background,
        )
        trainer = build_trainer(settings)
        save = trainer.parts.store.save

        def gated_save(model, step, *args, **kwargs):
            deadline = time.monotonic() + 3.0
            while step == 1 and _lines(metrics) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            return save(model, step, *args, **kwargs)

        trainer.parts.store.save = gated_save
        groups = [make_group(model_dir, g) for g in ("g1", "g2", "g3")]
        publish(settings, [s for g in groups for s in g])
        assert run_steps(trainer, steps=3) == 3
        trainer.close()
    finally:
        engine.close()

    events = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    span = {(e["stage"], e["step"]): (e["start"], e["end"]) for e in events}
    train2 = span[("train", 2)]
    for stage in ("push", "checkpoint"):
        start, end = span[(stage, 1)]
        assert start < train2[0], (stage, "begins after step 1")
        if background:
            assert end > train2[1], f"{stage} of step 1 ran while step 2 trained"
        else:
            assert end <= train2[0], f"{stage} of step 1 ended before step 2 began"
    assert engine.served == "3"
    # Each metrics row names the newest checkpoint and push that ended since the row before,
    # with the same span as the timeline's event of that job.
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for stage in ("push", "checkpoint"):
        reported = [r.get(f"{stage}_version") for r in rows]
        if background:  # step 1's jobs ended after step 2 trained (asserted above): not in row 1
            assert reported[0] is None, reported
            seen = [v for v in reported if v is not None]
            assert seen == sorted(set(seen)), reported  # each once, newest last
            if stage == "checkpoint":  # step 3's checkpoint waited for step 2's: row 3 has one
                assert seen and seen[-1] in (2, 3), reported
        else:  # on the critical path each row reports its own step's jobs
            assert reported == [1, 2, 3], reported
        for row in rows:
            if row.get(f"{stage}_version") is None:
                continue
            start, end = span[(stage, row[f"{stage}_version"])]
            assert row[f"{stage}_seconds"] == pytest.approx(end - start)
            assert end <= row["time"]  # ended before the row was written
            assert row[f"{stage}_bytes"] > 10 * 2**10  # at least the tiny model's weights


def test_one_push_reaches_two_real_engines_at_once(tmp_path, tiny_model_dir):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # any visible change
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = WeightsStore(tmp_path, tiny_model_dir).write(3, state)
    with engine_process(tiny_model_dir) as a, engine_process(tiny_model_dir) as b:
        pusher = WeightPusher([a, b], timeout_s=60, attempts=1)
        report = pusher.push(folder, 3)
        assert sorted(report.ok) == sorted([a, b]) and not report.failed and not report.skipped
        (s1, e1), (s2, e2) = report.spans[a], report.spans[b]
        assert max(s1, s2) < min(e1, e2), "the two engines' pushes overlap in time"
        for url in (a, b):
            info = httpx.get(f"{url}/model_info", timeout=10).json()
            assert info["weight_version"] == "3"
            served = httpx.post(
                f"{url}/get_weights_by_name",
                json={"name": "model.norm.weight", "truncate_size": 4},
                timeout=10,
            ).json()
            assert served == pytest.approx(state["model.norm.weight"][:4].tolist())
        # an older version is never pushed over a newer one
        older = pusher.push(folder, 2)
        assert sorted(older.skipped) == sorted([a, b])
        assert httpx.get(f"{a}/model_info", timeout=10).json()["weight_version"] == "3"


def _long_rows(url: str, n: int, out: list[dict]) -> list[threading.Thread]:
    def row(seed: int) -> None:
        body = {
            "text": "Once upon a time",
            "sampling_params": {
                "max_new_tokens": 400,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": seed,
            },
        }
        out.append(httpx.post(f"{url}/generate", json=body, timeout=300).json())

    threads = [threading.Thread(target=row, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("pause", ["none", "in_place"])
def test_rows_in_flight_continue_under_an_in_place_push(tmp_path, tiny_model_dir, pause):
    # On an engine that drains before a swap (engine.weight_swap = "drain"; the default "step"
    # swaps between decode steps, tests/integration/test_engine_swap_under_load.py):
    # none: the rows in flight finish on the old weights before the swap (one version each);
    # in_place: they continue under the new weights, and their later tokens carry version 1
    folder = WeightsStore(tmp_path, tiny_model_dir).write(
        1, {k: v.clone() for k, v in load_model(tiny_model_dir).state_dict().items()}
    )
    with engine_process(tiny_model_dir, threads="1", weight_swap="drain") as url:
        replies: list[dict] = []
        rows = _long_rows(url, 3, replies)
        time.sleep(0.3)  # the rows are decoding
        report = WeightPusher([url], timeout_s=120, attempts=1, pause=pause).push(folder, 1)
        for t in rows:
            t.join()
    assert report.ok == [url]
    spans = [r["meta_info"].get("weight_versions") or [] for r in replies]
    if pause == "in_place":
        mixed = [s for s in spans if {str(x["version"]) for x in s} == {"default", "1"}]
        assert mixed, spans  # at least one row changed weights mid-generation
        for s in mixed:  # old tokens first, then the new version to the end
            assert [str(x["version"]) for x in s] == ["default", "1"] and s[-1]["end"] == 400
    else:
        assert all(len({str(x["version"]) for x in s}) <= 1 for s in spans), spans
        assert {r["meta_info"]["weight_version"] for r in replies} == {"default"}
