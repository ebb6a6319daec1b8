"""OpenClaw-RL on one live turn through real processes: Redis, the policy engine, a separate
teacher engine, gateway, reward, teacher and trainer (the `Stack` behind `flywheel up`), and a
deterministic judge engine (`scripted_judge.py`, a real HTTP process speaking the OpenAI
protocol) behind both the reward service's next-state judge and the teacher's hint judge.

An `openai` SDK client answers a question, the user corrects it; the corrected turn's Sample
must carry the judge's verdict (-1) as its reward, the judge's hint, teacher logprobs computed
under the hinted context (hint appended to the last user message, docs/sessions.md), and the
trainer (`live_advantage = "opd_plus_rl"`) must step on A_t = (teacher - rollout) + r.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from flywheel._proto import sample_pb2, teacher_pb2, teacher_pb2_grpc
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.ops.stack import Stack
from flywheel.trainer.step import StepConfig, prepare_batch

from .live_turns import CORRECTION, corrected_turn, train_samples

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HINT = "Answer with only the number 8."
JUDGE = Path(__file__).with_name("scripted_judge.py")


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    log = tmp_path_factory.mktemp("judge") / "requests.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(JUDGE), "--hint", HINT, "--verdict", "-1", "--log", str(log)],
        stdout=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline().decode()  # type: ignore[union-attr]
        assert line.startswith("port "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/v1", log
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model_dir, judge):
    judge_url, _ = judge
    state = tmp_path_factory.mktemp("openclaw_state")
    port = {name: free_port() for name in ("engine", "gateway", "reward", "teacher", "teng", "tr")}
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": f"oclaw{uuid.uuid4().hex[:8]}", "block_ms": 200},
        engine={"model_path": str(tiny_model_dir), "port": port["engine"], "batch_wait_ms": 20},
        gateway={"port": port["gateway"], "default_max_tokens": 8},
        reward={
            "port": port["reward"],
            "metrics_port": 0,
            "judge": {"enabled": True, "base_url": judge_url, "votes": 1, "max_attempts": 1},
        },
        teacher={
            "enabled": True,
            "port": port["teacher"],
            "metrics_port": 0,
            "engine_port": port["teng"],
            "hint_judge": {"enabled": True, "base_url": judge_url, "votes": 1, "max_attempts": 1},
        },
        trainer={
            "port": port["tr"],
            "batch": {"groups_per_step": 1, "group_size": 8},
            "algorithm": {"live_advantage": "opd_plus_rl"},
            "checkpoint": {"dir": str(state / "ckpt")},
            "logging": {"metrics_path": str(state / "trainer_metrics.jsonl")},
        },
        state_dir=str(state),
    )
    with Stack(settings, echo=lambda _: None) as running:
        yield {s.name: s.url for s in running.services}, settings


def test_a_corrected_turn_trains_on_the_judge_reward_and_the_hinted_teacher(stack, judge):
    urls, settings = stack
    _, judge_log = judge
    session_id = corrected_turn(urls["gateway"], {}, correction_max_tokens=4)
    sample = train_samples(settings, session_id, turn_index=0)[0]

    # the judge's verdict and hint, both read from the turn's next state
    assert sample.has_reward and sample.rewards["judge"] == -1.0 and sample.reward == -1.0
    assert (sample.teacher_status, sample.hint) == ("scored", HINT)
    prompts = [
        json.loads(line)["messages"][-1]["content"] for line in judge_log.read_text().splitlines()
    ]
    hint_prompts = [p for p in prompts if "[HINT_START]" in p]
    assert hint_prompts and all(CORRECTION in p for p in prompts)
    assert len(hint_prompts) < len(prompts)  # the PRM judge was asked too

    # teacher context: the hint appended to the last user message under its label; the stored
    # logprobs are the teacher's for that context with no hint left to insert
    mask = list(sample.loss_mask)
    start = mask.index(1)
    assert list(sample.teacher_mask) == mask
    context = list(sample.messages)[:-1]
    last_user = context[-1]
    assert last_user.role == "user"
    hinted = sample_pb2.Message(
        role="user",
        content_json=json.dumps(
            f"{json.loads(last_user.content_json)}\n\n[Hindsight hint]\n{HINT}"
        ),
    )
    target = urls["teacher"].removeprefix("grpc://")
    with grpc.insecure_channel(target) as channel:
        scored = teacher_pb2_grpc.TeacherServiceStub(channel).ScoreTokens(
            teacher_pb2.ScoreTokensRequest(
                messages=[*context[:-1], hinted], response_ids=list(sample.token_ids[start:])
            ),
            timeout=60,
        )
    teacher = list(sample.teacher_logprobs[start:])
    assert teacher == pytest.approx(list(scored.logprobs), abs=1e-4)

    # the combined advantage: A_t = (teacher_t - rollout_t) + (-1) on each sampled token
    rollout = list(sample.rollout_logprobs[start:])
    expected = [t - r - 1.0 for t, r in zip(teacher, rollout, strict=True)]
    batch, metrics = prepare_batch([[sample]], StepConfig.from_settings(settings.trainer))
    assert batch.advantages_BT[0, start:].tolist() == pytest.approx(expected, abs=1e-5)
    assert metrics["adv_live/both_signals"] == 1

    # the trainer stepped on it with both signals: its logged advantage mean is this turn's
    metrics_path = Path(settings.trainer.logging.metrics_path)
    deadline = time.monotonic() + 300
    while True:
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        steps = [r for r in map(json.loads, lines) if r.get("adv_live/both_signals", 0) > 0]
        if steps:
            break
        assert time.monotonic() < deadline, "the trainer never stepped on the combined turn"
        time.sleep(0.5)
    assert steps[0]["adv_live/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-4)
    assert steps[0]["adv_live/both_signals"] == 1
