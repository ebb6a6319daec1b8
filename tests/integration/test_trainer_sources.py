"""The trainer loop on each source (redis with recording, replay, fake), live-mode samples, and
an engine left behind by a failed push, with a real Redis and fake engine HTTP endpoints."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file

from flywheel.trainer.service import build_trainer

from .test_trainer_service import (
    FakeEngine,
    make_group,
    model_dir,  # noqa: F401 (fixture)
    pending_count,
    publish,
    run_steps,
    trainer_settings,
    with_trainer,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def engines():
    pair = [FakeEngine(), FakeEngine()]
    yield pair
    for engine in pair:
        engine.close()


def test_recorded_stream_replays_to_the_same_weights(
    tmp_path, redis_server, prefix, engines, model_dir
):  # noqa: F811
    dump = tmp_path / "traffic.bin"
    live = with_trainer(
        trainer_settings(
            tmp_path / "live", redis_server, prefix, engines[0].url, model_dir=model_dir
        ),
        data={"record_path": str(dump)},
        logging={"tensorboard": False},
    )
    trainer = build_trainer(live)
    publish(live, make_group(model_dir, "g1"))
    assert run_steps(trainer) == 1
    trainer.close()

    replay = with_trainer(
        trainer_settings(
            tmp_path / "replay", redis_server, prefix, engines[1].url, model_dir=model_dir
        ),
        data={"source": "replay", "replay_path": str(dump)},
        logging={"tensorboard": False},
    )
    replayed = build_trainer(replay)
    assert run_steps(replayed, steps=5) == 1  # the dump holds one step; then it is used up
    replayed.close()
    a = load_file(tmp_path / "live" / "ckpt" / "step_00000001" / "model.safetensors")
    b = load_file(tmp_path / "replay" / "ckpt" / "step_00000001" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads(
        (tmp_path / "replay" / "ckpt" / "step_00000001" / "trainer_state.json").read_text()
    )
    # saved before the step's own acks: its entries are in entry_ids, acked again on resume
    assert state["source_position"] == {
        "kind": "replay",
        "path": str(dump),
        "position": 1,
        "done": [],
    }
    assert state["entry_ids"] == ["1-0", "2-0", "3-0", "4-0"]
    # resuming the finished replay trains nothing more
    again = build_trainer(replay)
    assert run_steps(again, steps=5) == 0
    again.close()


def test_fake_source_trains_alone_and_writes_tensorboard(
    tmp_path, redis_server, prefix, engines, model_dir
):  # noqa: F811
    settings = with_trainer(
        trainer_settings(tmp_path, redis_server, prefix, engines[0].url, model_dir=model_dir),
        data={"source": "fake", "fake_prompt_tokens": 6, "fake_completion_tokens": 10},
        batch={"micro_batch_tokens": 40},
    )
    trainer = build_trainer(settings)
    assert run_steps(trainer, steps=2) == 2
    trainer.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for key in [
        "tokens/per_s",
        "time/forward_backward_s",
        "time/checkpoint_s",
        "time/push_s",
        "adv/token_std",
        "tokens/masked_frac",
        "logprob/abs_diff/max",
        "loss/pg",
        "staleness/lag_mean",
        "grad/norm",
    ]:
        assert key in lines[1], key
    assert lines[1]["tokens/trained"] == 4 * 10 and lines[1]["batch/micro_batches"] == 2
    assert lines[1]["tokens/masked_frac"] == pytest.approx(6 / 16)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert [c["weight_version"] for c in engines[0].calls] == ["1", "2"]


def test_live_samples_without_group_id_train_on_their_reward(
    tmp_path, redis_server, prefix, engines, model_dir
):  # noqa: F811
    settings = trainer_settings(tmp_path, redis_server, prefix, engines[0].url, model_dir=model_dir)
    trainer = build_trainer(settings)
    live = make_group(model_dir, "", rewards=(1.0, -1.0, 1.0, -1.0))
    publish(settings, live)
    assert run_steps(trainer) == 1
    trainer.close()
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["samples/live"] == 4 and line["n_samples"] == 4
    assert line["adv_live/mean"] == pytest.approx(0.0)
    assert pending_count(settings) == 0


def test_an_engine_that_fails_the_push_is_reported_and_caught_up(
    tmp_path, redis_server, prefix, engines, model_dir
):  # noqa: F811
    good, bad = engines
    settings = with_trainer(
        trainer_settings(tmp_path, redis_server, prefix, good.url, model_dir=model_dir),
        push={"engine_urls": [good.url, bad.url], "attempts": 2},
    )
    trainer = build_trainer(settings)
    bad.fail = True
    publish(settings, make_group(model_dir, "g1"))
    assert run_steps(trainer) == 1  # one engine took version 1: training goes on
    status = trainer.parts.status.snapshot()
    assert list(status["engines_behind"]) == [bad.url]
    failures = REGISTRY.get_sample_value(
        "flywheel_trainer_weight_push_failures_total", {"engine": bad.url}
    )
    assert failures == 1.0
    assert [c["weight_version"] for c in bad.calls] == ["1", "1"]  # retried, then reported

    bad.fail = False
    publish(settings, make_group(model_dir, "g2"))
    assert run_steps(trainer) == 1
    assert [c["weight_version"] for c in bad.calls][-1] == "2"  # caught up with the newest
    assert trainer.parts.status.snapshot()["engines_behind"] == {}
    assert (
        REGISTRY.get_sample_value("flywheel_trainer_engine_weight_version", {"engine": bad.url})
        == 2.0
    )
    trainer.close()


def test_all_engines_failing_stops_the_trainer(tmp_path, redis_server, prefix, engines, model_dir):  # noqa: F811
    settings = trainer_settings(tmp_path, redis_server, prefix, engines[0].url, model_dir=model_dir)
    trainer = build_trainer(settings)
    engines[0].fail = True
    publish(settings, make_group(model_dir, "g1"))
    stop = threading.Event()
    with pytest.raises(Exception, match="no engine took weight version 1"):
        trainer.run(stop, max_steps=1)
    # the stop checkpointed the step (its entries are acked); a restart pushes it again
    assert pending_count(settings) == 0
    assert (tmp_path / "ckpt" / "step_00000001" / "trainer_state.json").is_file()
    trainer.close()
