"""Gateway overhead in front of an instant stub engine, side by side in one run.

    .venv/bin/python bench/gateway.py [--requests 300] [--rounds 2] [--compare-rev REV]

Targets, each a real process on loopback, all answering the same chat request:
- direct: the stub engine itself (bench/peers/stub_upstream.py), the floor;
- proxy: a minimal pass-through proxy (bench/peers/passthrough.py: raw ASGI on uvicorn + a
  pooled aiohttp client, the same server and client stack as the gateway): the floor;
- proxy-httpx: the same proxy on httpx, the client the openai SDK and most Python proxies
  use (for reference: how much of a proxy's cost is its HTTP client);
- gateway: `python -m flywheel.gateway` without a session (chat template, tokenization,
  `/generate` on the stub, reply parsing, OpenAI response);
- gateway-recorded: the same through a pre-created episode session (the turn is recorded in
  Redis: lock, stitch, save), i.e. the gateway's overhead with recording included;
- responses, responses-recorded: the same turn through `POST /v1/responses` on the same
  gateway (its CPU per request compared with the chat route's: target within 1.2x);
  responses-unstored: the same with `store: false` (no stored response, no Redis).
- messages, messages-recorded: the same turn through `POST /v1/messages` (Anthropic Messages)
  on the same gateway (target within 1.2x of the chat route's CPU per request, printed even
  when `--targets` picks only gateway, gateway-recorded, messages, messages-recorded).
For each target and concurrency 1/16/64: requests/s and p50/p99 latency over `--requests`
timed requests after a warm-up (best of `--rounds` interleaved rounds; the load comes from an
aiohttp client, bench/peers/request_loop.py), the latency each adds
over `direct` (p50/p99, ms), and the CPU time the target's own processes spend per request
(the proxy or gateway process; plus Redis for the recorded target; the stub's share is the
same for all and excluded), read from /proc. Ratios compare the gateway with the proxy (target:
gateway-recorded within 1.5x of the proxy's overhead). On a loaded shared machine wall-clock
latencies swing by several x between cells; CPU per request is the steadier overhead measure.

`--compare-rev REV` also runs the gateway of git revision REV (its `services/` tree exported to
a temporary folder, same settings, same Redis and stub): target gateway-recorded-B, printed as
the ratio of this tree's recorded CPU per request to REV's. `--targets` limits the run to some
targets (e.g. `--targets gateway-recorded,gateway-recorded-B`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

if TYPE_CHECKING:
    from flywheel.core.redis_server import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "peers"))
from request_loop import Driver  # noqa: E402  (bench/peers/request_loop.py)

BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}
LEVELS = (1, 16, 64)
CONTEXT_LENGTH = 131_072
"""The gateways' context window: the stub engine has none, long-session benches need room."""
RESPONSES_BODY = {"model": "m", "input": "What is 7 + 1?", "max_output_tokens": 8}
"""The same turn as `BODY` through `POST /v1/responses` (stored, as by default)."""
UNSTORED_BODY = {**RESPONSES_BODY, "store": False}
"""The same, `store: false` (target responses-unstored: what the stored response costs)."""
MESSAGES_BODY = {
    "model": "m",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "What is 7 + 1?"}],
}
"""The same turn as `BODY` through `POST /v1/messages`."""
ROUTES = {"responses": "/v1/responses", "messages": "/v1/messages"}
"""A target's route by its first word (any other target: /v1/chat/completions)."""
ROUNDS: dict[tuple[str, int], list[dict[str, float]]] = {}
"""Every round's result per (target, concurrency), in order (the report takes the best)."""
TARGETS = [
    "direct",
    "proxy",
    "proxy-httpx",
    "gateway",
    "gateway-recorded",
    "responses",
    "responses-recorded",
    "responses-unstored",
    "messages",
    "messages-recorded",
]


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
) -> tuple[dict[str, str], object, dict[str, list[int]]]:
    """Start the stub, the proxy, Redis and the gateway (and with `ab` or `source_b`, a second
    gateway with those gateway settings, from that `services/` folder: targets "gateway-B"
    and "gateway-recorded-B").

    Returns:
        (target -> URL, the Redis server, target -> pids whose CPU time is its overhead).
    """
    from flywheel.core.redis_server import LocalRedis, free_port  # noqa: PLC0415
    from flywheel.engine.convert import build_tiny_model  # noqa: PLC0415

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
        urls["gateway-recorded-B"] = urls["gateway-B"]
        pids["gateway-B"], pids["gateway-recorded-B"] = [proc.pid], [proc.pid, redis.proc.pid]
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


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


async def _paths(client: Driver, target: str, k: int) -> list[str]:
    route = ROUTES.get(target.split("-")[0], "/v1/chat/completions")
    if "recorded" not in target:
        return [route] * k
    made = await asyncio.gather(
        *[client.post("/v1/sessions", {"group_id": "bench"}) for _ in range(k)]
    )
    return [f"/s/{body['session_id']}{route}" for _, body in made]


async def cell(
    base: str, target: str, concurrency: int, n: int, pids: list[int]
) -> dict[str, float]:
    """Requests/s, latency percentiles (ms) and CPU ms per request of `pids` (n requests)."""
    kind = target.split("-")[0]
    body = {"responses": RESPONSES_BODY, "messages": MESSAGES_BODY}.get(kind, BODY)
    if target == "responses-unstored":
        body = UNSTORED_BODY
    async with Driver(base, concurrency) as client:
        await client.drain(await _paths(client, target, 2 * concurrency), body)  # warm-up
        timed = await _paths(client, target, n)
        cpu0, t0 = _cpu_s(pids), time.perf_counter()
        latencies, errors = await client.drain(timed, body)
        wall, cpu = time.perf_counter() - t0, _cpu_s(pids) - cpu0
    lat = sorted(latencies) or [float("nan")]

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000

    return {
        "rps": len(latencies) / wall,
        "p50": pct(0.5),
        "p99": pct(0.99),
        "errors": errors,
        "cpu_ms": cpu * 1000 / max(len(latencies), 1),
    }


def best(a: dict[str, float] | None, b: dict[str, float]) -> dict[str, float]:
    """The better of two rounds (higher requests/s)."""
    return b if a is None or b["rps"] > a["rps"] else a


def export_rev(rev: str, work: Path) -> Path:
    """The `services/` folder of git revision `rev`, exported under `work`.

    Raises:
        subprocess.CalledProcessError: `rev` is not a revision of this repository.
    """
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "services"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    out = work / "rev"
    out.mkdir()
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "services"


def report(results: dict[tuple[str, int], dict[str, float]], rev: str = "") -> list[str]:
    lines = [
        f"{'target':<17}{'conc':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'+p50 ms':>9}{'+p99 ms':>9}{'cpu ms/req':>11}{'errors':>8}"
    ]
    for c in LEVELS:
        for t in TARGETS:
            r = results[(t, c)]
            floor = results.get(("direct", c), r)
            lines.append(
                f"{t:<17}{c:>5}{r['rps']:>9.0f}{r['p50']:>9.2f}{r['p99']:>9.2f}"
                f"{r['p50'] - floor['p50']:>9.2f}{r['p99'] - floor['p99']:>9.2f}"
                f"{r['cpu_ms']:>11.2f}{r['errors']:>8.0f}"
            )
    if rev:
        lines.append("")
        lines.append(f"this tree / {rev} (recorded, cpu per request; target <= 1.0):")
        for c in LEVELS:
            a, b = results[("gateway-recorded", c)], results[("gateway-recorded-B", c)]
            each = [
                ra["cpu_ms"] / rb["cpu_ms"]
                for ra, rb in zip(
                    ROUNDS.get(("gateway-recorded", c), []),
                    ROUNDS.get(("gateway-recorded-B", c), []),
                    strict=True,
                )
            ]
            lines.append(
                f"  concurrency {c:>2}: {a['cpu_ms']:.2f} / {b['cpu_ms']:.2f} ms = "
                f"x{a['cpu_ms'] / b['cpu_ms']:.2f}; req/s x{a['rps'] / b['rps']:.2f}; "
                f"cpu per round {', '.join(f'x{r:.2f}' for r in each)} "
                f"(median x{statistics.median(each or [float('nan')]):.2f})"
            )
    lines += _route_ratios(results, "responses") + _route_ratios(results, "messages")
    if not {"direct", "proxy", "proxy-httpx", "gateway", "responses"} <= set(TARGETS):
        return lines
    lines.append("")
    lines.append("gateway / pass-through proxy (overhead ratios; target <= 1.5):")

    def ratio(num: float, den: float) -> str:
        return f"x{num / den:.2f}" if den > 0 else "n/a (proxy added no latency: noise)"

    for c in LEVELS:
        floor, proxy = results[("direct", c)], results[("proxy", c)]
        slow = results[("proxy-httpx", c)]
        parts = []
        for t in ("gateway", "gateway-recorded"):
            r = results[(t, c)]
            parts.append(
                f"{t}: cpu/req {ratio(r['cpu_ms'], proxy['cpu_ms'])}, added p50 "
                f"{ratio(r['p50'] - floor['p50'], proxy['p50'] - floor['p50'])}, added p99 "
                f"{ratio(r['p99'] - floor['p99'], proxy['p99'] - floor['p99'])}, req/s "
                f"{ratio(r['rps'], proxy['rps'])}"
            )
        lines.append(f"  concurrency {c:>2}: " + "; ".join(parts))
        rec = results[("gateway-recorded", c)]
        lines.append(
            f"  {'':>14}  (gateway-recorded / proxy-httpx: cpu/req "
            f"{ratio(rec['cpu_ms'], slow['cpu_ms'])}, added p50 "
            f"{ratio(rec['p50'] - floor['p50'], slow['p50'] - floor['p50'])})"
        )
        resp, resp_rec = results[("responses", c)], results[("responses-recorded", c)]
        lines.append(
            f"  {'':>14}  (/v1/responses / chat: cpu/req unrecorded "
            f"{ratio(resp['cpu_ms'], results[('gateway', c)]['cpu_ms'])}, recorded "
            f"{ratio(resp_rec['cpu_ms'], rec['cpu_ms'])}; target <= 1.2)"
        )
        if ("gateway-recorded-B", c) in results:
            b = results[("gateway-recorded-B", c)]
            lines.append(
                f"  {'':>14}  (gateway-recorded-B / gateway-recorded: cpu/req "
                f"{ratio(b['cpu_ms'], rec['cpu_ms'])}, req/s "
                f"{ratio(b['rps'], rec['rps'])})"
            )
    return lines


def _route_ratios(results: dict[tuple[str, int], dict[str, float]], route: str) -> list[str]:
    """`route`'s (responses, messages) CPU per request over the chat route's, unrecorded and
    recorded (when all four targets ran): the best rounds' ratio and the median of the
    per-round ratios (rounds are interleaved, so each round's pair met the same load)."""
    need = ("gateway", "gateway-recorded", route, f"{route}-recorded")
    if not all((t, c) in results for t in need for c in LEVELS):
        return []
    lines = [
        "",
        f"/v1/{route} / chat (cpu per request; target <= 1.2; best rounds, median of rounds):",
    ]
    for c in LEVELS:
        parts = []
        for name, mine, chat in (
            ("unrecorded", route, "gateway"),
            ("recorded", f"{route}-recorded", "gateway-recorded"),
        ):
            a, b = results[(mine, c)]["cpu_ms"], results[(chat, c)]["cpu_ms"]
            each = [
                ra["cpu_ms"] / rb["cpu_ms"]
                for ra, rb in zip(ROUNDS.get((mine, c), []), ROUNDS.get((chat, c), []), strict=True)
                if rb["cpu_ms"] > 0
            ]
            median = statistics.median(each) if each else float("nan")
            parts.append(f"{name} {a:.2f} / {b:.2f} ms = x{a / b:.2f} (median x{median:.2f})")
        if (f"{route}-unstored", c) in results:
            u = results[(f"{route}-unstored", c)]["cpu_ms"]
            chat = results[("gateway", c)]["cpu_ms"]
            parts.append(f"store: false {u:.2f} / {chat:.2f} ms = x{u / chat:.2f}")
        lines.append(f"  concurrency {c:>2}: " + "; ".join(parts))
    return lines


async def measure(
    urls: dict[str, str], pids: dict[str, list[int]], n: int, rounds: int
) -> dict[tuple[str, int], dict[str, float]]:
    results: dict[tuple[str, int], dict[str, float]] = {}
    for _ in range(rounds):  # interleaved, so drifting machine load hits every target alike
        for c in LEVELS:
            for t in TARGETS:
                key = (t, c)
                got = await cell(urls[t], t, c, n, pids[t])
                ROUNDS.setdefault(key, []).append(got)
                results[key] = best(results.get(key), got)
                print(f"  {t} at {c}: {results[key]['rps']:.0f} req/s", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="timed requests per cell")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--ab",
        metavar="KEY=JSON",
        action="append",
        default=[],
        help="also run a second gateway with this [gateway] setting (e.g. "
        "record_cache_mb=0): target gateway-recorded-B, compared "
        "side by side with gateway-recorded",
    )
    parser.add_argument(
        "--compare-rev",
        metavar="REV",
        default="",
        help="also run the gateway of this git revision: target gateway-recorded-B, its "
        "recorded CPU per request compared with this tree's",
    )
    parser.add_argument(
        "--targets", default="", help="comma-separated targets to run (default: all)"
    )
    args = parser.parse_args(argv)
    ab = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.ab)} or None
    if ab is not None or args.compare_rev:
        TARGETS.extend(["gateway-B", "gateway-recorded-B"])
    if args.targets:
        wanted = args.targets.split(",")
        unknown = set(wanted) - set(TARGETS)
        if unknown:
            parser.error(f"unknown targets {sorted(unknown)}; known: {TARGETS}")
        TARGETS[:] = [t for t in TARGETS if t in wanted]
    procs: list[subprocess.Popen] = []
    redis = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-gw-") as tmp:
        try:
            source_b = export_rev(args.compare_rev, Path(tmp)) if args.compare_rev else None
            urls, redis, pids = start(procs, Path(tmp), ab, source_b)
            load = os.getloadavg()[0]
            results = asyncio.run(measure(urls, pids, args.requests, args.rounds))
            print(
                f"{os.cpu_count()} CPUs, load average {load:.1f} at start; "
                f"{args.requests} requests per cell, best of {args.rounds} rounds"
                + (f"; gateway-recorded-B: {ab}" if ab else "")
                + (f"; gateway-recorded-B: {args.compare_rev}" if args.compare_rev else "")
            )
            print("\n".join(report(results, args.compare_rev)))
        finally:
            stop_all(procs, redis)
    return 0


if __name__ == "__main__":
    sys.exit(main())
