"""Gateway overhead side by side: Flywheel's gateway vs LiteLLM's proxy vs a minimal
pass-through proxy, all in front of the same instant stub upstream, at concurrency 1/16/64.

    bench/peers/setup_litellm.sh          # once: LiteLLM in its own venv (never .venv)
    .venv/bin/python bench/peers/gateway_overhead.py [--requests 400] [--rounds 2]

Targets (each a real process on loopback; the same chat request body for all):
- direct: the stub itself (the floor: client + stub cost only);
- passthrough: bench/peers/passthrough.py (raw ASGI + httpx: the least a proxy costs);
- litellm: `litellm --config` with one OpenAI-compatible model at the stub, master key set;
- flywheel: `python -m flywheel.gateway` with `auth = "on"` and an agent key, unrecorded
  `/v1/chat/completions` (key check, limits, chat template, tokenization, /generate on the
  stub, reply parsing, OpenAI response);
- flywheel-session: the same through a pre-created session's base_url (the turn is recorded in
  Redis: lock, stitch, save; nothing is published until finish).
Per target and concurrency: requests/s and p50/p99 latency over `--requests` requests after a
warm-up, best of `--rounds` interleaved rounds; then ratios of flywheel and flywheel-session
against LiteLLM and the pass-through. The stub answers instantly, so latency is the proxies'
own cost (plus the client's, equal for all). Prints a table and writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from request_loop import Driver  # bench/peers, this script's folder

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("FLYWHEEL_PEERS_DIR", Path.home() / ".cache/flywheel/peers"))
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}
LEVELS = (1, 16, 64)
LITELLM_KEY = "sk-bench-" + os.urandom(8).hex()
KEYS: dict[str, str] = {}
"""API key per target: LiteLLM's master key, a Flywheel agent key (both authenticate)."""


def _port() -> int:
    from flywheel.core.redis_server import free_port  # noqa: PLC0415

    return free_port()


class Procs:
    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[subprocess.Popen] = []
        self.redis = None

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115  (owned by the child)
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.stop()
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _wait(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not up within {timeout_s} s")


def start_targets(procs: Procs, work: Path, with_litellm: bool) -> dict[str, str]:
    """Start every target; returns name -> base URL (Redis is kept in `procs.redis`)."""
    from flywheel.core.auth import KeyStore  # noqa: PLC0415
    from flywheel.core.cpu_libs import without_triton  # noqa: PLC0415
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.redis_server import LocalRedis  # noqa: PLC0415
    from flywheel.engine.convert import build_tiny_model  # noqa: PLC0415

    without_triton()  # the tiny model's build imports torch; Triton's exit-time leak report off
    py = sys.executable
    stub_port = _port()
    stub = procs.start(
        "stub", [py, str(ROOT / "bench/peers/stub_upstream.py"), "--port", str(stub_port)]
    )
    stub_url = f"http://127.0.0.1:{stub_port}"
    _wait(f"{stub_url}/health", 60, stub)
    targets = {"direct": stub_url}

    port = _port()
    proc = procs.start(
        "passthrough",
        [py, str(ROOT / "bench/peers/passthrough.py"), "--port", str(port), "--upstream", stub_url],
    )
    _wait(f"http://127.0.0.1:{port}/health", 60, proc)
    targets["passthrough"] = f"http://127.0.0.1:{port}"

    if with_litellm:
        litellm = PEERS / "litellm" / "bin" / "litellm"
        if not litellm.exists():
            raise SystemExit(
                "LiteLLM is not installed: run bench/peers/setup_litellm.sh first "
                "(or pass --no-litellm)"
            )
        cfg = work / "litellm.yaml"
        cfg.write_text(
            "model_list:\n  - model_name: m\n    litellm_params:\n      model: openai/stub\n"
            f"      api_base: {stub_url}/v1\n      api_key: sk-stub\n"
            "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
        )
        port = _port()
        env = {
            **os.environ,
            "LITELLM_LOG": "ERROR",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "DISABLE_SCHEMA_UPDATE": "true",
            "LITELLM_MASTER_KEY": LITELLM_KEY,
        }
        proc = procs.start(
            "litellm",
            [
                str(litellm),
                "--config",
                str(cfg),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--num_workers",
                "1",
            ],
            env=env,
        )
        _wait(f"http://127.0.0.1:{port}/health/liveliness", 300, proc)
        targets["litellm"] = f"http://127.0.0.1:{port}"
        KEYS["litellm"] = LITELLM_KEY

    redis = procs.redis = LocalRedis(work / "redis").start()
    port = _port()
    cfg = {
        "redis": {"url": redis.url},
        "streams": {"prefix": "bench"},
        "gateway": {
            "port": port,
            "engine_urls": [stub_url],
            "tokenizer_path": str(build_tiny_model(work / "tiny")),
            "security": {"auth": "on"},
        },
        "log_level": "WARNING",
    }
    (work / "gateway.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    proc = procs.start(
        "flywheel", [py, "-m", "flywheel.gateway", "--config", str(work / "gateway.json")], env=env
    )
    _wait(f"http://127.0.0.1:{port}/readyz", 180, proc)
    targets["flywheel"] = f"http://127.0.0.1:{port}"
    targets["flywheel-session"] = targets["flywheel"]
    KEYS["flywheel"] = KEYS["flywheel-session"] = KeyStore(connect(redis.url), "bench").create(
        "agent", "bench"
    )[0]
    return targets


async def _paths(client: Driver, k: int, session: bool) -> list[str]:
    """k request paths; for sessions one fresh (eval) session each, created before timing."""
    if not session:
        return ["/v1/chat/completions"] * k
    made = await asyncio.gather(*[client.post("/v1/sessions", {"eval": True}) for _ in range(k)])
    return [f"/s/{body['session_id']}/v1/chat/completions" for _, body in made]


async def _run(base: str, concurrency: int, n: int, session: bool, key: str = "") -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with Driver(base, concurrency, headers) as client:
        warm = await _paths(client, 2 * concurrency, session)
        timed = await _paths(client, n, session)  # made first: no idle gap before timing
        await client.drain(warm, BODY)
        t0 = time.perf_counter()
        latencies, errors = await client.drain(timed, BODY)
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0)
    return {"rps": len(lat) / wall, "p50_ms": pick(0.5), "p99_ms": pick(0.99), "errors": errors}


def _machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu}), "
        f"Python {platform.python_version()}, load average {load:.1f} at start"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="timed requests per cell")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (best kept)")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--out", default="runs/peers/gateway_overhead.json")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="flywheel-overhead-"))
    procs = Procs(work)
    machine = _machine()
    try:
        targets = start_targets(procs, work, not args.no_litellm)
        results: dict[str, dict[int, dict]] = {t: {} for t in targets}
        for level in LEVELS:
            n = max(args.requests, level * 4)
            for _ in range(args.rounds):
                for name, base in targets.items():
                    r = asyncio.run(
                        _run(
                            base,
                            level,
                            n,
                            session=name == "flywheel-session",
                            key=KEYS.get(name, ""),
                        )
                    )
                    best = results[name].get(level)
                    if best is None or r["rps"] > best["rps"]:
                        results[name][level] = r
    finally:
        procs.stop()
    print(f"machine: {machine}")
    print(f"{'target':18} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for name, by_level in results.items():
        for level, r in by_level.items():
            print(
                f"{name:18} {level:>4} {r['rps']:>9.1f} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['errors']:>6}"
            )
    print("\nratios (flywheel / peer; req/s > 1 and latency < 1 favour flywheel)")
    for ours in ("flywheel", "flywheel-session"):
        for peer in ("litellm", "passthrough"):
            if peer not in results or ours not in results:
                continue
            for level in LEVELS:
                f, p = results[ours][level], results[peer][level]
                print(
                    f"  {ours:16} vs {peer:11} c={level:<3} req/s x{f['rps'] / p['rps']:.2f}  "
                    f"p50 x{f['p50_ms'] / p['p50_ms']:.2f}  p99 x{f['p99_ms'] / p['p99_ms']:.2f}"
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"machine": machine, "requests": args.requests, "results": results}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
