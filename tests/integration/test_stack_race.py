"""Two stacks started at the same instant with the same configured ports (real processes: each
its own Redis and gateway): they get different ports, and each stack's gateway is its own
process (its /readyz reports that stack's instance nonce)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from flywheel.core.redis_server import reserve_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

UP = textwrap.dedent("""
    import json, pathlib, sys, time
    from flywheel.core.settings import load_settings
    from flywheel.ops.stack import Stack
    state, go, model, redis_port, gateway_port = sys.argv[1:6]
    settings = load_settings(state_dir=state, redis={"port": int(redis_port)},
                             engine={"model_path": model}, gateway={"port": int(gateway_port)})
    stack = Stack(settings, echo=lambda _: None, only=("gateway",))
    print("ready", flush=True)
    while not pathlib.Path(go).exists():
        time.sleep(0.001)
    try:
        stack.start(startup_timeout_s=300)
        print(json.dumps({"instance": stack.instance, "gateway": stack.services[0].url,
                          "redis": settings.redis.url}), flush=True)
        sys.stdin.read()
    finally:
        stack.stop()
""")


def test_two_stacks_starting_at_once_get_their_own_ports_and_processes(tmp_path, tiny_model_dir):
    base = reserve_port(0)
    redis_port, gateway_port = base.port + 1, base.port + 50
    base.release()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                UP,
                str(tmp_path / f"state{k}"),
                str(go),
                str(tiny_model_dir),
                str(redis_port),
                str(gateway_port),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        go.touch()
        stacks = []
        for p in procs:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            stacks.append(json.loads(line))
        assert stacks[0]["gateway"] != stacks[1]["gateway"]
        assert stacks[0]["redis"] != stacks[1]["redis"]
        assert stacks[0]["instance"] != stacks[1]["instance"]
        for stack in stacks:  # each gateway answers for its own stack
            ready = httpx.get(f"{stack['gateway']}/readyz", timeout=30).json()
            assert ready["instance"] == stack["instance"]
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(timeout=120)
    assert [p.returncode for p in procs] == [0, 0]
