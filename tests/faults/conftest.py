"""Real processes for fault tests: stub engines (fault modes), gateways, Redis, reward workers.

Every process started here is killed at teardown; each waits on a bounded health check.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flywheel.core.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "bench" / "peers" / "stub_upstream.py"


class Procs:
    """Started child processes, killed (whole process group) at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], name: str, **kw) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115  (owned by the child)
        proc = subprocess.Popen(
            argv,
            stdout=kw.pop("stdout", log),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
            **kw,
        )
        self.procs.append(proc)
        return proc

    def stub(self, mode: str = "ok") -> str:
        """A stub engine in `mode`; returns its base URL."""
        proc = self.spawn(
            [sys.executable, str(STUB), "--port", "0", "--mode", mode],
            f"stub-{mode}",
            stdout=subprocess.PIPE,
        )
        line = proc.stdout.readline().decode()
        assert line.startswith("port "), line
        return f"http://127.0.0.1:{int(line.split()[1])}"

    def gateway(
        self,
        redis_url: str,
        prefix: str,
        engine_urls: list[str],
        tokenizer: Path,
        port: int = 0,
        streams: dict | None = None,
        **gateway: object,
    ) -> str:
        """A gateway process (python -m flywheel.gateway); returns its URL once /healthz is ok.
        `streams`: more `[streams]` settings."""
        port = port or free_port()
        cfg = {
            "redis": {"url": redis_url},
            "streams": {"prefix": prefix, **(streams or {})},
            "gateway": {
                "port": port,
                "engine_urls": engine_urls,
                "tokenizer_path": str(tokenizer),
                **gateway,
            },
        }
        path = self.tmp / f"gateway-{port}.json"
        path.write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        self.spawn(
            [sys.executable, "-m", "flywheel.gateway", "--config", str(path)],
            f"gateway-{port}",
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", 60)
        return url

    def reward(self, redis_url: str, prefix: str, **reward: object) -> subprocess.Popen:
        """A reward service process (python -m flywheel.reward); returns once its gRPC port is
        open. `streams` settings may be passed as `streams={...}`."""
        streams = {"prefix": prefix, "block_ms": 100, **reward.pop("streams", {})}
        port = free_port()
        cfg = {
            "redis": {"url": redis_url},
            "streams": streams,
            "reward": {"port": port, "metrics_port": 0, **reward},
        }
        path = self.tmp / f"reward-{port}.json"
        path.write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        proc = self.spawn(
            [sys.executable, "-m", "flywheel.reward", "--config", str(path)],
            f"reward-{port}",
            env=env,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, (self.tmp / f"reward-{port}.log").read_text()[-3000:]
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return proc
            time.sleep(0.2)
        raise TimeoutError("reward service did not open its port within 90 s")

    @staticmethod
    def calls(url: str) -> int:
        """`/generate` calls a stub engine has received."""
        return httpx.get(f"{url}/stats", timeout=5).json()["calls"]

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


class ThreadServer:
    """A gateway app built in this process, served by uvicorn on a real port in a thread (it
    talks real HTTP to stub engine processes; no interpreter start-up per test)."""

    def __init__(self, app):
        import uvicorn  # noqa: PLC0415

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(f"{self.url}/healthz", 30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def renderer(tiny_model_dir):
    from flywheel.gateway.render.tokenization import ChatRenderer  # noqa: PLC0415

    return ChatRenderer(tiny_model_dir)


@pytest.fixture
def inproc_gateway(redis_client, prefix, renderer):
    """`inproc_gateway(engine_urls, high_water=..., **gateway_settings)` -> base URL."""
    from flywheel.core.settings import GatewaySettings  # noqa: PLC0415
    from flywheel.core.streams import StreamProducer  # noqa: PLC0415
    from flywheel.gateway.app import create_app  # noqa: PLC0415
    from flywheel.gateway.deps import GatewayDeps  # noqa: PLC0415
    from flywheel.gateway.engines.pool import EnginePool  # noqa: PLC0415
    from flywheel.gateway.session.store import SessionStore  # noqa: PLC0415

    servers = []

    def start(engine_urls: list[str], high_water: int = 10_000, client=None, **gateway) -> str:
        settings = GatewaySettings(**gateway)
        client = client or redis_client
        deps = GatewayDeps(
            settings=settings,
            renderer=renderer,
            engines=EnginePool(engine_urls, settings.request_timeout_s, {2}),
            sessions=SessionStore(client, prefix, 3600),
            publisher=StreamProducer(
                client, f"{prefix}:rollouts", high_water=high_water, watch_group="reward"
            ),
            context_length=2048,
        )
        servers.append(ThreadServer(create_app(deps)))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()
