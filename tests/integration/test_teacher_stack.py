"""The teacher on the real local stack: Redis, the policy engine, a separate teacher engine,
gateway, reward, teacher and trainer as processes (the `Stack` behind `flywheel up`), driven in
live mode by the official `openai` SDK.

What this proves: a live turn that the user corrects reaches the `train` stream with a hint and
teacher logprobs aligned to its token ids, computed by the teacher service on its own engine (the
same numbers its gRPC ScoreTokens returns for the hinted context), and the trainer's `opd`
advantage of that Sample is nonzero exactly on the turn's sampled tokens.

The trainer (live samples with `live_advantage = "opd"`, one live sample per step) then trains
on it and pushes new weights to the policy engine only: the teacher engine keeps its weights.

What it does not prove: that a judge LLM writes good hints. The model is a tiny random-weight
Llama (with the real SmolLM2 tokenizer), useless as a judge, so the hinted turn takes its hint
from the environment (`task["hint"]` of the session), which is deterministic. The judge path runs
too, against the same tiny model over real HTTP: its replies are not in the hint format, so that
turn is recorded with `teacher_status` "no_hint" and no teacher logprobs, not dropped.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from flywheel._proto import teacher_pb2, teacher_pb2_grpc
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.ops.stack import Stack
from flywheel.trainer.algorithms.advantages import ADVANTAGES, AdvantageConfig, AdvantageInputs

from .live_turns import CORRECTION, corrected_turn, train_samples

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HINT = "The user wants only the number 8, with no other words."


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model_dir):
    state = tmp_path_factory.mktemp("teacher_state")
    # Ports from the OS (not fixed numbers), so a concurrent run of this module cannot collide.
    port = {
        name: free_port()
        for name in (
            "engine",
            "gateway",
            "reward",
            "reward_metrics",
            "teacher",
            "teacher_metrics",
            "teacher_engine",
            "trainer",
        )
    }
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": f"tstack{uuid.uuid4().hex[:8]}", "block_ms": 200},
        engine={"model_path": str(tiny_model_dir), "port": port["engine"], "batch_wait_ms": 20},
        gateway={"port": port["gateway"], "default_max_tokens": 8},
        reward={"port": port["reward"], "metrics_port": port["reward_metrics"]},
        teacher={
            "enabled": True,
            "port": port["teacher"],
            "metrics_port": port["teacher_metrics"],
            "engine_port": port["teacher_engine"],
            "hint_judge": {
                "enabled": True,
                "base_url": f"http://127.0.0.1:{port['engine']}/v1",
                "votes": 2,
                "max_tokens": 16,
                "max_attempts": 1,
            },
        },
        trainer={
            "port": port["trainer"],
            "batch": {"groups_per_step": 1, "group_size": 8},
            "algorithm": {"live_advantage": "opd"},
            "checkpoint": {"dir": str(state / "ckpt")},
            "logging": {"metrics_path": str(state / "trainer_metrics.jsonl")},
        },
        state_dir=str(state),
    )
    with Stack(settings, echo=lambda _: None) as running:
        yield {s.name: s.url for s in running.services}, settings


def test_a_corrected_live_turn_gets_a_hint_teacher_logprobs_and_an_opd_advantage(stack):
    urls, settings = stack
    teacher_engine = urls["teacher-engine"]
    assert teacher_engine not in settings.trainer_engine_urls()  # never gets weight pushes
    session_id = corrected_turn(urls["gateway"], {"hint": HINT}, correction_max_tokens=8)
    (sample,) = train_samples(settings, session_id)

    assert sample.turn_index == 0 and json.loads(sample.next_state.content_json) == CORRECTION
    assert (sample.teacher_status, sample.hint) == ("scored", HINT)
    assert sample.teacher_weight_version == "default"
    assert sample.teacher_model == settings.engine.model_path.rstrip("/").split("/")[-1]
    mask = list(sample.loss_mask)
    assert list(sample.teacher_mask) == mask and sum(mask) > 0
    assert len(sample.teacher_logprobs) == len(sample.token_ids)

    # The stored logprobs are what the teacher's gRPC API gives for the hinted context.
    start = mask.index(1)
    response_ids = list(sample.token_ids[start:])
    target = urls["teacher"].removeprefix("grpc://")
    with grpc.insecure_channel(target) as channel:
        reply = teacher_pb2_grpc.TeacherServiceStub(channel).ScoreTokens(
            teacher_pb2.ScoreTokensRequest(
                messages=list(sample.messages)[:-1], response_ids=response_ids, hint=HINT
            ),
            timeout=60,
        )
    assert list(sample.teacher_logprobs[start:]) == pytest.approx(list(reply.logprobs), abs=1e-4)

    # The trainer's opd advantage: teacher - rollout logprob, nonzero exactly on sampled tokens.
    inputs = AdvantageInputs(
        rewards_B=torch.zeros(1),
        group_index_B=torch.zeros(1, dtype=torch.long),
        teacher_logprobs_BT=torch.tensor([list(sample.teacher_logprobs)]),
        rollout_logprobs_BT=torch.tensor([list(sample.rollout_logprobs)]),
        teacher_mask_BT=torch.tensor([list(sample.teacher_mask)], dtype=torch.bool),
    )
    adv_T = ADVANTAGES["opd"](inputs, AdvantageConfig()).advantages_BT[0]
    assert (adv_T != 0).tolist() == [bool(m) for m in mask]
    expected = torch.tensor(list(sample.teacher_logprobs)) - torch.tensor(
        list(sample.rollout_logprobs)
    )
    torch.testing.assert_close(adv_T[start:], expected[start:])


def test_a_turn_without_a_valid_hint_is_recorded_as_no_hint(stack):
    urls, settings = stack
    session_id = corrected_turn(urls["gateway"], {}, correction_max_tokens=8)
    (sample,) = train_samples(settings, session_id)
    assert sample.teacher_status == "no_hint" and sample.hint == ""
    assert set(sample.teacher_mask) == {0} and sum(sample.loss_mask) > 0
    metrics = httpx.get(f"http://127.0.0.1:{settings.teacher.metrics_port}/metrics").text
    assert 'flywheel_teacher_samples_total{status="no_hint"} 1.0' in metrics


def test_the_trainer_steps_on_the_opd_gap_and_the_teacher_engine_keeps_its_weights(stack):
    urls, settings = stack
    # An answer makes the reward service score the turn: the trainer admits only rewarded Samples.
    session_id = corrected_turn(
        urls["gateway"], {"hint": HINT, "answer": 8}, correction_max_tokens=8
    )
    (sample,) = train_samples(settings, session_id)
    assert sample.has_reward and sample.teacher_status == "scored"
    metrics_path = Path(settings.trainer.logging.metrics_path)

    def opd_steps():
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        records = [json.loads(line) for line in lines]
        return [r for r in records if r.get("adv_live/teacher_token_frac", 0) > 0]

    deadline = time.monotonic() + 300
    while not opd_steps():
        assert time.monotonic() < deadline, "the trainer never stepped on a teacher-scored sample"
        time.sleep(0.5)

    def version(url: str) -> str:
        return httpx.get(f"{url}/model_info").json()["weight_version"]

    while version(urls["engine"]) == "default":  # the push follows the step's checkpoint
        assert time.monotonic() < deadline, "the trainer never pushed weights to the engine"
        time.sleep(0.5)
    assert version(urls["teacher-engine"]) == "default"
