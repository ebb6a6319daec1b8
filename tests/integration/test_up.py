"""`flywheel up` as a user runs it: a config file, a real Redis it starts itself, every service
healthy and printed, and Ctrl-C (SIGINT) stopping all of them."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from flywheel.core.fleet import Fleet
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.versions import parse_weight_version
from flywheel.ops.up import CHECK_S

from .up_cli import clean_env, run_up, up_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_prints_urls_and_ctrl_c_stops_everything(tmp_path, tiny_model_dir):
    tiny = tiny_model_dir
    state = tmp_path / "state"
    cfg = tmp_path / "flywheel.toml"
    # free ports, so a stack already running on this machine (defaults 8000...) moves nothing
    redis_port, engine_port, gw_port, reward_port, metrics_port, trainer_port = (
        free_port() for _ in range(6)
    )
    cfg.write_text(
        f'state_dir = "{state}"\n'
        f'[redis]\nport = {redis_port}\n[engine]\nmodel_path = "{tiny}"\nport = {engine_port}\n'
        f"[gateway]\nport = {gw_port}\n[reward]\nport = {reward_port}\n"
        f"metrics_port = {metrics_port}\n"
        f'[trainer]\nport = {trainer_port}\n[trainer.checkpoint]\ndir = "{state}/ckpt"\n'
        f'[trainer.logging]\nmetrics_path = "{state}/m.jsonl"\n'
    )
    env = clean_env()
    proc = subprocess.Popen(
        up_command(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "flywheel is up" in line:
                break
        out = "".join(lines)
        assert "flywheel is up" in out, out
        for name in ("redis", "engine", "gateway", "reward", "trainer"):
            assert any(ln.startswith(name) for ln in lines), out
        stack = json.loads((state / "stack.json").read_text())
        assert stack["gateway"] == f"http://127.0.0.1:{gw_port}"
        assert httpx.get(f"{stack['gateway']}/readyz").status_code == 200
        sid = _check_fidelity_of_a_recorded_session(stack["gateway"], cfg, env)
        _redis_killed_is_started_again(proc, stack["gateway"], sid)
        _trainer_killed_is_started_again(proc, stack["trainer"])
        _service_killed_is_started_again(proc, "flywheel.reward", stack, sid)
        _service_killed_is_started_again(proc, "flywheel.gateway", stack, sid)
        _service_killed_is_started_again(proc, "flywheel.engine", stack, sid)
        # Back on its initial weights, the engine serves again only at the fleet's version.
        fleet = Fleet(connect(stack["redis_url"]), "flywheel", [])
        served = httpx.get(f"{stack['engine']}/model_info", timeout=10).json()
        assert parse_weight_version(served["weight_version"]) >= fleet.version()
        time.sleep(2 * CHECK_S)  # the watch loop's next pass reports it healthy again
        second = subprocess.run(
            [sys.executable, "-m", "flywheel.ops.cli", "up", "--config", str(cfg)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert second.returncode == 1 and "already running" in second.stderr
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis-server, engine, gateway, reward, trainer
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped." in rest
    assert "flywheel: redis exited with -9; started it again" in rest
    assert "flywheel: trainer exited with -9; started it again (1 of 3 within 600 s)" in rest
    for name in ("reward", "gateway", "engine"):
        assert f"flywheel: {name} exited with -9; started it again (1 of 3 within 600 s)" in rest
        assert f"flywheel: {name} is healthy again" in rest
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after Ctrl-C: {alive}"
    assert not (state / "stack.json").exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{stack['gateway']}/healthz", timeout=2)


def _redis_killed_is_started_again(up: subprocess.Popen, gateway: str, sid: str) -> None:
    """SIGKILL the stack's redis-server: `flywheel up` starts it again on its data (AOF), the
    gateway is ready again and the finished session is still there; nothing else stops."""
    (server,) = [
        c
        for c in psutil.Process(up.pid).children(recursive=True)
        if c.name().startswith("redis-server")
    ]
    server.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (
                httpx.get(f"{gateway}/readyz", timeout=5).status_code == 200
                and not server.is_running()
            ):
                break
        time.sleep(0.5)
    assert up.poll() is None, "flywheel up stopped when its redis died"
    assert httpx.get(f"{gateway}/readyz", timeout=5).status_code == 200
    assert httpx.get(f"{gateway}/v1/sessions/{sid}", timeout=5).json()["status"] == "finished"


def _trainer_killed_is_started_again(up: subprocess.Popen, trainer: str) -> None:
    """SIGKILL the trainer: `flywheel up` starts it again (it resumes from its checkpoint and
    commit log) and every other service keeps its process."""
    children = psutil.Process(up.pid).children(recursive=True)

    def is_trainer(p: psutil.Process) -> bool:
        try:
            return "flywheel.trainer" in " ".join(p.cmdline())
        except psutil.Error:  # a process that is gone (or a zombie)
            return False

    (old,) = [c for c in children if is_trainer(c)]
    others = {c.pid for c in children if not is_trainer(c)}
    old.kill()
    deadline = time.monotonic() + 120
    new: list[psutil.Process] = []
    while time.monotonic() < deadline:
        new = [
            c
            for c in psutil.Process(up.pid).children(recursive=True)
            if is_trainer(c) and c.pid != old.pid
        ]
        with contextlib.suppress(httpx.HTTPError):
            if new and httpx.get(f"{trainer}/readyz", timeout=5).status_code == 200:
                break
        time.sleep(0.5)
    assert up.poll() is None, "flywheel up stopped when its trainer died"
    assert new, "the trainer was not started again"
    assert httpx.get(f"{trainer}/readyz", timeout=5).status_code == 200
    alive = {c.pid for c in psutil.Process(up.pid).children(recursive=True)}
    assert others <= alive, "another service was restarted"


def _service_killed_is_started_again(
    up: subprocess.Popen, module: str, stack: dict[str, str], sid: str
) -> None:
    """SIGKILL one service (`python -m <module>`): `flywheel up` starts it again and the other
    services keep their processes; the finished session and every recorded rollout are still
    there, and an episode finished afterwards is recorded and scored (the reward group reads
    and acks it)."""
    from flywheel.core.settings import StreamSettings  # noqa: PLC0415

    def is_it(p: psutil.Process) -> bool:
        try:
            return module in " ".join(p.cmdline())
        except psutil.Error:
            return False

    redis = connect(stack["redis_url"])
    rollouts = StreamSettings().key("rollouts")
    recorded = redis.xlen(rollouts)
    children = psutil.Process(up.pid).children(recursive=True)
    (old,) = [c for c in children if is_it(c)]
    others = {c.pid for c in children if not is_it(c)}
    old.kill()
    gateway = stack["gateway"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [c for c in psutil.Process(up.pid).children(recursive=True) if is_it(c)]
        with contextlib.suppress(httpx.HTTPError):
            if new and new[0].pid != old.pid and _episode_scored(gateway, redis, rollouts):
                break
        time.sleep(1)
    assert up.poll() is None, f"flywheel up stopped when {module} died"
    assert new and new[0].pid != old.pid, f"{module} was not started again"
    alive = {c.pid for c in psutil.Process(up.pid).children(recursive=True)}
    assert others <= alive, "another service was restarted"
    assert httpx.get(f"{gateway}/v1/sessions/{sid}", timeout=5).json()["status"] == "finished"
    assert redis.xlen(rollouts) > recorded  # nothing lost, the new episode added
    assert _reward_caught_up(redis)


def _episode_scored(gateway: str, redis, rollouts: str) -> bool:  # noqa: ANN001
    """Finish a one-turn episode through the gateway; True once the reward group has read and
    acked every rollout (within 30 s)."""
    with httpx.Client(base_url=gateway, timeout=120) as client:
        if client.get("/readyz").status_code != 200:
            return False
        sid = client.post("/v1/sessions", json={"group_id": "after-kill"}).json()["session_id"]
        reply = client.post(
            f"/s/{sid}/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4,
            },
        )
        if reply.status_code != 200:
            return False
        client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).raise_for_status()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _reward_caught_up(redis):
            return True
        time.sleep(0.5)
    return False


def _reward_caught_up(redis) -> bool:  # noqa: ANN001
    """The reward group has read and acked every rollout (lag 0, pending 0)."""
    from flywheel.core.settings import StreamSettings  # noqa: PLC0415
    from flywheel.core.stream_stats import stream_stats  # noqa: PLC0415

    (stat,) = [s for s in stream_stats(redis, StreamSettings()) if s.name == "rollouts"]
    groups = {g.group: g for g in stat.groups}
    return "reward" in groups and (groups["reward"].lag, groups["reward"].pending) == (0, 0)


def _check_fidelity_of_a_recorded_session(gateway: str, cfg, env: dict[str, str]) -> str:
    """`flywheel check-fidelity` on a finished two-turn session: one line per Sample naming
    it, its segment and turn, every check passing (exit 0); an unknown session: exit 1."""
    with httpx.Client(base_url=gateway, timeout=120) as client:
        sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
        messages = [{"role": "user", "content": "Say hi"}]
        for _ in range(2):
            reply = client.post(
                f"/s/{sid}/v1/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": 4},
            ).json()
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "again"}]
        assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
    cli = [sys.executable, "-m", "flywheel.ops.cli", "check-fidelity", "--config", str(cfg)]
    done = subprocess.run(
        [*cli, "--session", sid], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "(segment 0, turn 1)" in lines[0], done.stdout  # one episode
    assert "ids_match=True" in lines[0]
    missing = subprocess.run(
        [*cli, "--session", "nope"], capture_output=True, text=True, env=env, timeout=120
    )
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("flywheel: no recorded Sample of session nope"), missing.stderr
    return sid


def test_up_says_at_once_what_external_engine_it_waits_for(tmp_path, tiny_model_dir):
    """`engine.backend = "external"` with nothing at the URL: `flywheel up` prints the wait
    (URL, limit) before it times out, then fails with the setting to change."""
    state = tmp_path / "state"
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(
        f'state_dir = "{state}"\n[redis]\nport = 16479\n'
        f'[engine]\nbackend = "external"\nurls = ["http://127.0.0.1:9"]\n'
        f'model_path = "{tiny_model_dir}"\nstartup_timeout_s = 3\n'
    )
    done = run_up(cfg, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "engine    waiting for http://127.0.0.1:9/health (up to 3 s)" in done.stdout
    assert "did not answer /health with 200 within 3s" in done.stderr
    assert "engine.startup_timeout_s sets the wait" in done.stderr
