"""Process start-up for the gateway benches: the stub engine, the pass-through proxies, Redis and
the gateways (this tree's, or another revision's `services/` folder), CPU pinning, and stop.

Used by bench/gateway.py, bench/gateway_tail.py, bench/gateway_long.py and bench/gateway_live.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from flywheel.core.redis_server import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_LENGTH = 131_072
"""The gateways' context window: the stub engine has none, long-session benches need room."""


def _start(
    procs: list[subprocess.Popen],
    logs: Path,
    name: str,
    argv: list[str],
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "wb")  # noqa: SIM115  (owned by the child)
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )
    procs.append(proc)
    return proc


def pin(pid: int, cpus: set[int]) -> None:
    """Keep every thread of process `pid` (and threads they start later) on the CPUs `cpus`.

    Raises:
        OSError: no such process, or `cpus` holds no CPU this machine has.
    """
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(the CPUs for the load: driver, stub, proxies, Redis; the CPUs for the gateways) on a
    machine with 2 or more CPUs this process may use: the last CPU for the gateways, the rest
    for the load. None on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return set(cpus[:-1]), {cpus[-1]}


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Poll `url` until it answers 200 (a process started at low priority on a loaded machine
    may take minutes to import).

    Raises:
        RuntimeError: `proc` exited first. TimeoutError: not ready within `timeout_s` s.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")


def _gateway(
    procs: list[subprocess.Popen],
    work: Path,
    name: str,
    redis_url: str,
    stub: str,
    tokenizer: Path,
    extra: dict[str, object],
    source: Path | None = None,
) -> tuple[str, subprocess.Popen]:
    """Start a gateway (from `source`, another checkout's `services/` folder, when given)."""
    from flywheel.core.redis_server import free_port  # noqa: PLC0415

    port = free_port()
    cfg = {
        "redis": {"url": redis_url},
        "streams": {"prefix": "bench"},
        "log_level": "WARNING",
        "engine": {"context_length": CONTEXT_LENGTH},
        "gateway": {"port": port, "engine_urls": [stub], "tokenizer_path": str(tokenizer), **extra},
    }
    (work / f"{name}.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    if source is not None:  # first on the path: its flywheel package, not this tree's
        env["PYTHONPATH"] = str(source)
    proc = _start(
        procs,
        work,
        name,
        [sys.executable, "-m", "flywheel.gateway", "--config", str(work / f"{name}.json")],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    _wait(f"{url}/readyz", proc)
    return url, proc


def start(
    procs: list[subprocess.Popen],
    work: Path,
    ab: dict[str, object] | None = None,
    source_b: Path | None = None,
    target_cpus: set[int] | None = None,
) -> tuple[dict[str, str], object, dict[str, list[int]]]:
    """Start the stub, the proxy, Redis and the gateway (and with `ab` or `source_b`, a second
    gateway with those gateway settings, from that `services/` folder: targets "gateway-B"
    and "gateway-recorded-B"). With `target_cpus`, the proxies and gateways run on those CPUs
    (`pin`), the rest where this process runs.

    Returns:
        (target -> URL, the Redis server, target -> pids whose CPU time is its overhead).
    """
    from flywheel.core.cpu_libs import without_triton  # noqa: PLC0415
    from flywheel.core.redis_server import LocalRedis, free_port  # noqa: PLC0415
    from flywheel.engine.convert import build_tiny_model  # noqa: PLC0415

    without_triton()  # the tiny model's build imports torch; Triton's exit-time leak report off
    py = sys.executable
    stub = f"http://127.0.0.1:{(port := free_port())}"
    proc = _start(procs, work, "stub", [py, "bench/peers/stub_upstream.py", "--port", str(port)])
    _wait(f"{stub}/health", proc)
    proxies = {}
    for name, client in (("proxy", "aiohttp"), ("proxy-httpx", "httpx")):
        proxies[name] = f"http://127.0.0.1:{(port := free_port())}"
        proc = _start(
            procs,
            work,
            name,
            [
                py,
                "bench/peers/passthrough.py",
                "--port",
                str(port),
                "--upstream",
                stub,
                "--client",
                client,
            ],
        )
        _wait(f"{proxies[name]}/health", proc)
    redis = LocalRedis(work / "redis").start()
    tokenizer = build_tiny_model(work / "tiny")
    gateway, proc = _gateway(procs, work, "gateway", redis.url, stub, tokenizer, {})
    urls = {"direct": stub, **proxies, "gateway": gateway, "gateway-recorded": gateway}
    urls |= {"responses": gateway, "responses-recorded": gateway, "responses-unstored": gateway}
    urls |= {"messages": gateway, "messages-recorded": gateway}
    pids = {
        "direct": [procs[0].pid],
        "proxy": [procs[1].pid],
        "proxy-httpx": [procs[2].pid],
        "gateway": [proc.pid],
        "gateway-recorded": [proc.pid, redis.proc.pid],
        "responses": [proc.pid, redis.proc.pid],  # a stored response is one Redis SET
        "responses-recorded": [proc.pid, redis.proc.pid],
        "responses-unstored": [proc.pid],  # store: false touches no Redis
        "messages": [proc.pid],
        "messages-recorded": [proc.pid, redis.proc.pid],
    }
    if ab is not None or source_b is not None:
        urls["gateway-B"], proc = _gateway(
            procs, work, "gateway-b", redis.url, stub, tokenizer, ab or {}, source_b
        )
        urls["gateway-recorded-B"] = urls["responses-B"] = urls["gateway-B"]
        pids["gateway-B"], pids["gateway-recorded-B"] = [proc.pid], [proc.pid, redis.proc.pid]
        pids["responses-B"] = [proc.pid, redis.proc.pid]
    if target_cpus is not None:
        for p in procs[1:]:  # all but the stub: the proxies and gateways
            pin(p.pid, target_cpus)
    return urls, redis, pids


def stop_all(procs: list[subprocess.Popen], redis: LocalRedis | None) -> None:
    """Stop every started process group (SIGTERM, then SIGKILL after 15 s) and Redis (or None)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if redis is not None:
        redis.stop()
