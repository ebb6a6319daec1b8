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
import socket
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch

from flywheel._proto import teacher_pb2, teacher_pb2_grpc
from flywheel.core.codec import decode_sample
from flywheel.core.redis_client import connect
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD
from flywheel.ops.stack import Stack
from flywheel.trainer.algorithms.advantages import ADVANTAGES, AdvantageConfig, AdvantageInputs

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HINT = "The user wants only the number 8, with no other words."
QUESTION = "What is 7 + 1?"
CORRECTION = "No, that is wrong. 7 + 1 = 8. Reply with just the number."


def _os_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model_dir):
    state = tmp_path_factory.mktemp("teacher_state")
    # Ports from the OS (not fixed numbers), so a concurrent run of this module cannot collide.
    port = {
        name: _os_port()
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


def _live_turns(gateway: str, task: dict) -> str:
    """Turn 0 answers the question; the user's correction is its next state. Returns the id."""
    session = httpx.post(f"{gateway}/v1/sessions", json={"mode": "live", "task": task}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="test")
    first = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=first, temperature=1.0, max_tokens=8
    )
    answer = {"role": "assistant", "content": reply.choices[0].message.content}
    client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=1.0,
        max_tokens=8,
        messages=[*first, answer, {"role": "user", "content": CORRECTION}],
    )
    return session["session_id"]


def _train_samples(settings, session_id: str, n: int = 1, timeout_s: float = 120.0) -> list:
    client = connect(settings.redis_url())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [decode_sample(f[FIELD]) for _, f in client.xrange(settings.streams.key("train"))]
        mine = [s for s in got if s.session_id == session_id]
        if len(mine) >= n:
            return mine
        time.sleep(0.25)
    dead = client.xrange(settings.streams.key("dead"))
    raise AssertionError(f"no train sample for {session_id}; dead letters: {dead}")


def test_a_corrected_live_turn_gets_a_hint_teacher_logprobs_and_an_opd_advantage(stack):
    urls, settings = stack
    teacher_engine = urls["teacher-engine"]
    assert teacher_engine not in settings.trainer_engine_urls()  # never gets weight pushes
    session_id = _live_turns(urls["gateway"], {"hint": HINT})
    (sample,) = _train_samples(settings, session_id)

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
    session_id = _live_turns(urls["gateway"], {})
    (sample,) = _train_samples(settings, session_id)
    assert sample.teacher_status == "no_hint" and sample.hint == ""
    assert set(sample.teacher_mask) == {0} and sum(sample.loss_mask) > 0
    metrics = httpx.get(f"http://127.0.0.1:{settings.teacher.metrics_port}/metrics").text
    assert 'flywheel_teacher_samples_total{status="no_hint"} 1.0' in metrics


def test_the_trainer_steps_on_the_opd_gap_and_the_teacher_engine_keeps_its_weights(stack):
    urls, settings = stack
    # An answer makes the reward service score the turn: the trainer admits only rewarded Samples.
    session_id = _live_turns(urls["gateway"], {"hint": HINT, "answer": 8})
    (sample,) = _train_samples(settings, session_id)
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
