"""End to end: the reward service (a real process) judges live turns with the real embedded
engine serving SmolLM2-135M-Instruct behind its OpenAI endpoint (/v1/chat/completions).

The 135M model is a poor judge, so this asserts the plumbing, not its taste: every vote is either
a valid verdict in {-1, 0, +1} whose reply ends with the verdict line, or an invalid vote with a
failure kind; the judgment is judged (majority of the valid votes) or unjudged with a reason;
the prompt version is recorded; the metrics count every vote and call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from flywheel._proto import reward_pb2, reward_pb2_grpc
from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD, StreamProducer
from flywheel.reward.parsing import majority

pytestmark = [pytest.mark.integration, pytest.mark.slow]
VOTES = 3
KINDS = {
    "timeout",
    "connection",
    "server_error",
    "client_error",
    "bad_response",
    "no_verdict",
    "invalid_value",
}


def _start(module, config, log_path):
    log = open(log_path, "wb")  # noqa: SIM115  (owned by the child)
    return subprocess.Popen(
        [sys.executable, "-m", module],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "FLYWHEEL_CONFIG": str(config)},
    )


def _wait(check, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, grpc.RpcError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} not up in {timeout_s} s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, smollm2_dir):
    state = tmp_path_factory.mktemp("reward_e2e")
    engine_port = free_port(31461)
    port, metrics_port = free_port(50461), free_port(9461)
    settings = load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": "rjudge", "block_ms": 100},
        engine={"model_path": str(smollm2_dir), "port": engine_port, "batch_wait_ms": 20},
        reward={
            "port": port,
            "metrics_port": metrics_port,
            "default_verifier": "none",
            "judge": {
                "enabled": True,
                "base_url": f"http://127.0.0.1:{engine_port}/v1",
                "votes": VOTES,
                "max_tokens": 32,
                "max_attempts": 1,
                "timeout_s": 120,
                "temperature": 0.7,
            },
        },
        state_dir=str(state),
    )
    config = state / "settings.json"
    config.write_text(json.dumps(settings.model_dump(mode="json")))
    procs = [_start("flywheel.engine", config, state / "engine.log")]
    try:
        engine = f"http://127.0.0.1:{engine_port}"
        _wait(lambda: httpx.get(f"{engine}/health", timeout=5).status_code == 200, 180, "engine")
        procs.append(_start("flywheel.reward", config, state / "reward.log"))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        yield channel, settings, f"http://127.0.0.1:{metrics_port}/metrics"
        channel.close()
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)


def _turn(sample_id):
    s = new_sample(sample_id=sample_id, mode="live", task_json="{}")
    s.messages.add(role="user", content_json=json.dumps("What is 2 + 3?"))
    s.messages.add(role="assistant", content_json=json.dumps("2 + 3 = 5."))
    s.next_state.role = "user"
    s.next_state.content_json = json.dumps("Great, thanks! That is right.")
    return s


def _check_judgment(rewards, has_reward, error, votes):
    assert len(votes) == VOTES
    assert {v.judge for v in votes} == {"judge:prm@v2"}  # prompt version recorded
    valid = []
    for v in votes:
        if v.has_value:
            assert v.value in (-1.0, 0.0, 1.0)
            assert "final verdict" in v.explanation.strip().splitlines()[-1].lower()
            valid.append(v.value)
        else:
            assert v.explanation.split(":")[0] in KINDS, v.explanation
    if valid:
        assert has_reward and rewards["judge"] == majority(valid)
    else:
        assert not has_reward and error.startswith("unjudged: judge ")
        assert "judge" not in rewards
    return len(valid)


def test_live_turns_judged_by_the_engine_over_grpc_and_the_stream(stack):
    channel, settings, metrics_url = stack
    client = connect(settings.redis_url())
    # the stream turn and the gRPC turn are judged at the same time (the engine batches them)
    StreamProducer(client, settings.streams.key("rollouts")).publish(_turn("streamed"))
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    resp = stub.Score(reward_pb2.ScoreRequest(sample=_turn("grpc")), timeout=300)
    _check_judgment(resp.rewards, resp.has_reward, resp.error, resp.votes)

    deadline = time.monotonic() + 300
    out = []
    while not out and time.monotonic() < deadline:
        out = [decode_sample(f[FIELD]) for _, f in client.xrange(settings.streams.key("train"))]
        time.sleep(0.5)
    (sample,) = out
    _check_judgment(sample.rewards, sample.has_reward, sample.error, sample.votes)

    text = httpx.get(metrics_url, timeout=5).text
    values = {}
    for line in text.splitlines():
        if line.startswith("flywheel_reward_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    votes = sum(
        v
        for k, v in values.items()
        if k.startswith('flywheel_reward_judge_votes_total{judge="judge"')
    )
    assert votes == 2 * VOTES  # both turns' votes, each counted once
    assert values['flywheel_reward_judge_call_seconds_count{judge="judge"}'] == 2 * VOTES
    judged = values.get('flywheel_reward_judged_total{judge="judge"}', 0.0)
    unjudged = sum(
        v for k, v in values.items() if k.startswith('flywheel_reward_unjudged_total{judge="judge"')
    )
    assert judged + unjudged == 2
