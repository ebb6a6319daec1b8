"""`flywheel demo --api-key` (env FLYWHEEL_API_KEY) against a gateway that requires API keys:
a real gateway app (auth on, keys in real Redis, a canned engine answering "8") served over real
HTTP by uvicorn. Without a valid key the demo refuses at start (exit 2) saying how to pass one;
with it every agent and the driver's session requests carry it; an episode refused 401 is
worded as the key's problem, not the server's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

import flywheel.ops.stack as stack_module
from flywheel.core.redis_server import free_port
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.ops import cli
from flywheel.ops.demo.agent_runner import AgentDemoConfig, AgentDemoRunner
from flywheel.ops.demo.agent_tasks import AdditionProblem
from flywheel.ops.demo.runner import DemoConfig, DemoRunner
from flywheel.ops.demo.tasks import Problem
from tests.security.conftest import Gateway, build_gateway


@pytest.fixture(scope="module")
def renderer(smollm2_dir) -> ChatRenderer:
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def keyed(redis_client, prefix, renderer) -> Iterator[tuple[str, Gateway]]:
    """(URL, gateway) of a gateway that requires keys (auth on), served over HTTP."""
    gw = build_gateway(redis_client, prefix, renderer, auth="on")
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(gw.client.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    try:
        yield url, gw
    finally:
        server.should_exit = True
        thread.join(10)


def _running_stack(monkeypatch, tmp_path, url: str) -> None:
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(stack_module, "running_stack", lambda _: {"gateway": url, "engine": url})


def test_without_a_key_the_demo_refuses_at_start_saying_how_to_pass_one(
    monkeypatch, tmp_path, keyed, capsys
):
    url, gw = keyed
    _running_stack(monkeypatch, tmp_path, url)
    monkeypatch.delenv("FLYWHEEL_API_KEY", raising=False)
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--steps", "1", "--problems-per-step", "4"]
    assert cli.main([*argv, "--group-size", "8"]) == 2
    err = capsys.readouterr().err
    assert f"the gateway at {url} requires an API key (401" in err, err
    assert "--api-key KEY" in err and "FLYWHEEL_API_KEY" in err
    assert "flywheel keys create --role agent" in err
    assert gw.engine.calls == [] and not (out / "metrics.jsonl").exists()  # nothing ran

    revoked = gw.key("agent")
    gw.keys.revoke(gw.keys.verify(revoked).key_id)
    assert cli.main([*argv, "--group-size", "8", "--api-key", revoked]) == 2
    assert "refused the demo's API key (401" in capsys.readouterr().err


def test_the_key_from_the_environment_reaches_the_driver_and_every_agent(
    monkeypatch, tmp_path, keyed, capsys
):
    url, gw = keyed
    key = gw.key("agent")
    _running_stack(monkeypatch, tmp_path, url)
    monkeypatch.setenv("FLYWHEEL_API_KEY", key)
    seen = {}

    def one_step(self, started_at=None):  # noqa: ANN001, ANN202
        seen["rewards"] = self.rollouts([Problem(5, 3)])  # real episodes through the gateway
        seen["failed"] = self.failed
        return {"first5": 1.0, "last5": 1.0, "eval_before": 0.0, "eval_after": 1.0, "steps": 1}

    monkeypatch.setattr(DemoRunner, "run", one_step)
    argv = ["demo", "--out", str(tmp_path / "demo"), "--steps", "1"]
    assert cli.main([*argv, "--problems-per-step", "4", "--group-size", "8"]) == 0
    assert seen == {"rewards": [1.0] * 8, "failed": 0}  # "8" is 5 + 3
    assert len(gw.engine.calls) == 8


def test_episodes_carry_the_key_and_a_401_is_worded_as_the_keys_problem(tmp_path, keyed):
    url, gw = keyed
    cfg = DemoConfig(steps=1, problems_per_step=1, group_size=2)
    lines: list[str] = []
    keyed_runner = DemoRunner(url, url, cfg, tmp_path, lines.append, api_key=gw.key("agent"))
    assert keyed_runner.access_refusal() is None
    assert keyed_runner.rollouts([Problem(5, 3)]) == [1.0, 1.0]
    assert keyed_runner.failed == 0 and lines == []

    no_key = DemoRunner(url, url, cfg, tmp_path, lines.append)
    assert no_key.rollouts([Problem(5, 3)]) == [0.0, 0.0]
    assert no_key.failed == 2 and len(lines) == 2
    assert all("refused by the gateway (401: missing API key" in line for line in lines), lines
    assert not any("failed on the server" in line for line in lines)
    assert "--api-key KEY" in lines[0]


def test_the_tool_agent_carries_the_key(tmp_path, keyed):
    url, gw = keyed
    cfg = AgentDemoConfig(steps=1, problems_per_step=1, group_size=1)
    problem = AdditionProblem(241, 567)
    lines: list[str] = []
    runner = AgentDemoRunner(url, url, cfg, tmp_path, lines.append, api_key=gw.key("agent"))
    runner.agent_episode(problem, "g-1", evaluation=False, temperature=0.0)
    assert runner.failed == 0 and lines == [] and len(gw.engine.calls) == 1

    no_key = AgentDemoRunner(url, url, cfg, tmp_path, lines.append)
    assert no_key.agent_episode(problem, "g-2", evaluation=False, temperature=0.0).reward == 0
    assert no_key.failed == 1 and "refused by the gateway (401" in lines[0], lines
    assert httpx.get(f"{url}/v1/models").status_code == 401
