"""User-defined rewards through the real reward service process: plugin modules named in
`reward.plugins` (the recipe's example and tests/integration/reward_plugins_for_tests.py) are
imported at start, Samples from a real Redis `rollouts` stream are scored by them and come out
on `train`; a plugin that raises, returns NaN or leaves its range leaves the Sample unscored,
counted by reward and reason, and logged, never 0. A plugin that cannot be imported stops the
service at start with a message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from flywheel._proto import reward_pb2, reward_pb2_grpc
from flywheel.core.codec import decode_sample, new_sample
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.core.streams import FIELD, StreamProducer

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).parents[2]
PYTHONPATH = os.pathsep.join(
    [
        str(ROOT / "recipes" / "plugins"),
        str(Path(__file__).parent),
        os.environ.get("PYTHONPATH", ""),
    ]
)


def _settings(
    state: Path, redis_url: str, plugins: list[str], prefix: str, **reward: object
) -> Path:
    settings = load_settings(
        redis={"url": redis_url},
        streams={"prefix": prefix, "block_ms": 100},
        reward={
            "port": free_port(50361),
            "metrics_port": free_port(9361),
            "plugins": plugins,
            "default_verifier": "length_exact",
            **reward,
        },
        state_dir=str(state),
    )
    config = state / "settings.json"
    config.write_text(json.dumps(settings.model_dump(mode="json")))
    return config


def _sample(sample_id: str, reply: str, task: dict, next_state: str | None = None):
    s = new_sample(task_json=json.dumps(task), sample_id=sample_id)
    s.messages.add(role="user", content_json=json.dumps("What is 7 + 1?"))
    s.messages.add(role="assistant", content_json=json.dumps(reply))
    if next_state is not None:
        s.next_state.role = "user"
        s.next_state.content_json = json.dumps(next_state)
    return s


def test_plugin_rewards_score_the_stream_and_failures_are_unscored(tmp_path, redis_server):
    # "thanked" also runs on every Sample as its own component, weight 0.5 (0.25 without thanks)
    config = _settings(
        tmp_path,
        redis_server.url,
        ["length_exact", "reward_plugins_for_tests"],
        "plug",
        components=["thanked"],
        weights={"thanked": 0.5},
    )
    settings = load_settings(config)
    log_path = tmp_path / "reward.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flywheel.reward"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FLYWHEEL_CONFIG": str(config), "PYTHONPATH": PYTHONPATH},
        )
        try:
            client = connect(settings.redis_url())
            src = StreamProducer(client, settings.streams.key("rollouts"))
            # default verifier length_exact, budget 10: "So 7+1 is\n8" is 11 chars, 1 over:
            # 1 - 1/10 = 0.9
            src.publish(_sample("long", "So 7+1 is\n8", {"answer": 8, "max_chars": 10}))
            src.publish(_sample("short", "8", {"answer": 8, "max_chars": 10}))  # 1.0
            src.publish(_sample("wrong", "9", {"answer": 8}))  # 0.0, scored
            # "thanked" reads the next state: thanks -> 0.75, none -> 0.25
            src.publish(_sample("thanks", "8", {"verifier": "thanked"}, "thanks!"))
            src.publish(_sample("no-next", "8", {"verifier": "thanked"}))
            for name in ("raises", "nan", "too_big"):
                bad = _sample(f"bad-{name}", "8", {"verifier": name, "answer": 8})
                bad.rewards["outcome"] = 0.5  # an environment's outcome is kept, never combined
                src.publish(bad)
            deadline = time.monotonic() + 90
            out: dict = {}
            while len(out) < 8 and time.monotonic() < deadline and proc.poll() is None:
                out = {
                    decode_sample(f[FIELD]).sample_id: decode_sample(f[FIELD])
                    for _, f in client.xrange(settings.streams.key("train"))
                }
                time.sleep(0.2)
            assert len(out) == 8, log_path.read_text()[-3000:]
            scored = {k: (s.has_reward, s.reward, dict(s.rewards)) for k, s in out.items()}
            approx = pytest.approx
            # reward = verifier + 0.5 * thanked; thanked = 0.25 unless the next state thanks
            # long: 0.9 + 0.5 * 0.25 = 1.025; short: 1 + 0.125 = 1.125; wrong: 0 + 0.125
            assert scored["long"] == (
                True,
                approx(1.025),
                {"verifier": approx(0.9), "thanked": 0.25},
            )
            assert scored["short"] == (True, 1.125, {"verifier": 1.0, "thanked": 0.25})
            assert scored["wrong"] == (True, 0.125, {"verifier": 0.0, "thanked": 0.25})
            # verifier "thanked" too: thanks: 0.75 + 0.5 * 0.75 = 1.125; none: 0.25 + 0.125
            assert scored["thanks"] == (True, 1.125, {"verifier": 0.75, "thanked": 0.75})
            assert scored["no-next"] == (True, 0.375, {"verifier": 0.25, "thanked": 0.25})
            reasons = {"raises": "exception", "nan": "not_finite", "too_big": "out_of_range"}
            for name, reason in reasons.items():
                s = out[f"bad-{name}"]
                assert not s.has_reward, name
                assert dict(s.rewards) == {"outcome": 0.5, "thanked": 0.25}  # no "verifier"
                assert s.error.startswith(f"reward {name} {reason}: "), s.error
            assert "RuntimeError: cannot score '8'" in out["bad-raises"].error
            assert "outside its declared range [0, 1]" in out["bad-too_big"].error

            text = httpx.get(
                f"http://127.0.0.1:{settings.reward.metrics_port}/metrics", timeout=5
            ).text
            lines = dict(
                line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#"
            )
            for name, reason in reasons.items():
                key = f'flywheel_reward_plugin_unscored_total{{reason="{reason}",reward="{name}"}}'
                assert float(lines[key]) == 1.0, key
            assert float(lines['flywheel_reward_samples_total{outcome="unscored"}']) == 3.0
            assert float(lines['flywheel_reward_samples_total{outcome="scored"}']) == 5.0
            # the gRPC Score path uses the same scorer: 0.75 + 0.5 * 0.75 = 1.125; NaN unscored
            channel = grpc.insecure_channel(f"127.0.0.1:{settings.reward.port}")
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            thanks = _sample("grpc-thanks", "8", {"verifier": "thanked"}, "thanks!")
            resp = stub.Score(reward_pb2.ScoreRequest(sample=thanks), timeout=30)
            assert (resp.has_reward, resp.reward) == (True, 1.125)
            nan = _sample("grpc-nan", "8", {"verifier": "nan"})
            resp = stub.Score(reward_pb2.ScoreRequest(sample=nan), timeout=30)
            assert not resp.has_reward and resp.error.startswith("reward nan not_finite: ")
            assert dict(resp.rewards) == {"thanked": 0.25}
            channel.close()
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    text = log_path.read_text()
    for name, reason in reasons.items():
        assert (
            f"reward '{name}' (reward_plugins_for_tests) left sample bad-{name} unscored: "
            f"{reason}" in text
        )
    assert "registered ['length_exact', 'nan', 'raises', 'thanked', 'too_big']" in text


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        (["no_such_reward_module"], "reward plugin 'no_such_reward_module' cannot be imported"),
        (["length_exact"], None),  # loads; but default_verifier below is misspelled
    ],
)
def test_a_bad_plugin_or_verifier_stops_the_service_at_start(
    tmp_path, redis_server, plugins, message
):
    config = _settings(tmp_path, redis_server.url, plugins, "plugbad")
    data = json.loads(config.read_text())
    if message is None:
        data["reward"]["default_verifier"] = "length_exactt"
        message = "reward.default_verifier 'length_exactt' is not a verifier"
    config.write_text(json.dumps(data))
    done = subprocess.run(
        [sys.executable, "-m", "flywheel.reward"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FLYWHEEL_CONFIG": str(config), "PYTHONPATH": PYTHONPATH},
    )
    assert done.returncode == 1
    assert f"flywheel-reward: {message}" in done.stderr
    assert "Traceback" not in done.stderr
