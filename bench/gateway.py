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
For each target and concurrency 1/16/64 (`--concurrency`): requests/s and p50/p99 latency over
`--requests` timed requests after a warm-up (best of `--rounds` rounds; the load comes from an
aiohttp client, bench/peers/request_loop.py), the latency each adds over `direct` (p50/p99,
ms), and the CPU time the target's own processes spend per request (the proxy or gateway
process; plus Redis for the recorded target; the stub's share is the same for all and
excluded; the Redis share is also printed on its own, column `redis`): user + system time of
all their threads, in nanoseconds from
/proc/<pid>/task/<tid>/schedstat (in 10 ms ticks from /proc/<pid>/stat where the kernel lacks
it). Ratios compare the gateway with the proxy (target: gateway-recorded within 1.5x of the
proxy's overhead). On a loaded shared machine wall-clock latencies swing by several x between
cells; CPU per request is the steadier overhead measure.

Steadiness on a small shared machine: within a round, every target's timed requests go in
`--slices` slices taken in turn (target 1's first slice, target 2's, ..., then the second
slices), so a change in the machine's load meets every target alike; each round starts one
target further along; and on 2+ CPUs the proxies and gateways run on the last CPU and the load
(this driver, the stub engine, Redis) on the others (`--no-pin`: anywhere). Ratios between
targets are printed per round: their median and lowest-highest, beside the best rounds' ratio.
Each slice holds at least `--slice-min` (16) times the concurrency in requests (1024 at 64,
however small `--requests / --slices`) and follows as many untimed requests of its own target
as the concurrency: a slice shorter than that is mostly its ramp-up and drain, and lasts so
little (a fifth of a second at 64) that one collector pass or timer in the target lands whole
in one target's slice (`--slice-min 0`: the method before, for comparison).

A/A check of the method: a target named twice (`--targets gateway,gateway`) runs twice, the
copy ("gateway#2") with its own client and slices on the same processes, and its CPU per
request over the target's is printed per round (ideally x1.00; the spread is the method's).

`--compare-rev REV` also runs the gateway of git revision REV (its `services/` tree exported to
a temporary folder, same settings, same Redis and stub): target gateway-recorded-B, printed as
the ratio of this tree's recorded CPU per request to REV's; and target responses-B (REV's stored
`/v1/responses`), whose ratio to gateway-B (REV's chat route) is printed beside this tree's
responses / gateway. `--targets` limits the run to some targets (e.g. `--targets
gateway-recorded,gateway-recorded-B` or `--targets gateway,responses,gateway-B,responses-B`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    pass

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "peers"))
from gateway_report import report  # noqa: E402  (bench/gateway_report.py)
from gateway_stack import pin, split_cpus, start, stop_all  # noqa: E402, F401  (bench/gateway_stack.py; re-exported for the other gateway benches)
from request_loop import Driver  # noqa: E402  (bench/peers/request_loop.py)

BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 7 + 1?"}], "max_tokens": 8}
LEVELS = (1, 16, 64)
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
SCHEDSTAT = os.path.exists("/proc/self/schedstat")
"""Whether this kernel reports each thread's CPU time in nanoseconds (`_cpu_s`)."""
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


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` have used so far, all their threads.

    Read from each thread's `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on the CPU) where
    the kernel has it; else from `/proc/<pid>/stat` (psutil: user + system in clock ticks,
    10 ms each, about 5% of a 400-request cell at 0.5 ms per request).
    """
    total = 0.0
    for pid in pids:
        if SCHEDSTAT:
            tasks = os.listdir(f"/proc/{pid}/task")
            total += sum(_thread_ns(pid, tid) for tid in tasks) / 1e9
        else:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def _thread_ns(pid: int, tid: str) -> int:
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except FileNotFoundError:  # the thread ended meanwhile
        return 0


def base(target: str) -> str:
    """The target a name stands for: "gateway#2" (the A/A copy `--targets gateway,gateway`
    makes) -> "gateway"; any other name -> itself."""
    return target.split("#")[0]


async def _paths(client: Driver, target: str, k: int) -> list[str]:
    target = base(target)
    route = ROUTES.get(target.split("-")[0], "/v1/chat/completions")
    if "recorded" not in target:
        return [route] * k
    made: list[tuple[int, dict[str, str]]] = []
    for first in range(0, k, client.concurrency):  # no POST waits long for a connection
        made += await asyncio.gather(
            *[
                client.post("/v1/sessions", {"group_id": "bench"})
                for _ in range(min(client.concurrency, k - first))
            ]
        )
    return [f"/s/{body['session_id']}{route}" for _, body in made]


def _body(target: str) -> dict[str, object]:
    target = base(target)
    if target == "responses-unstored":
        return UNSTORED_BODY
    return {"responses": RESPONSES_BODY, "messages": MESSAGES_BODY}.get(target.split("-")[0], BODY)


def _stats(
    latencies: list[float], errors: int, wall: float, cpu: float, redis_cpu: float = 0.0
) -> dict[str, float]:
    lat = sorted(latencies) or [float("nan")]

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000

    return {
        "rps": len(latencies) / wall,
        "p50": pct(0.5),
        "p99": pct(0.99),
        "errors": errors,
        "cpu_ms": cpu * 1000 / max(len(latencies), 1),
        "redis_ms": redis_cpu * 1000 / max(len(latencies), 1),
    }


async def cell(
    base: str, target: str, concurrency: int, n: int, pids: list[int]
) -> dict[str, float]:
    """Requests/s, latency percentiles (ms) and CPU ms per request of `pids` (n requests)."""
    got = await level({target: base}, {target: pids}, [target], concurrency, n, 1)
    return got[target]


async def settle(pids: list[int], quiet_s: float = 0.001, timeout_s: float = 2.0) -> None:
    """Wait until the processes `pids` are quiet: under `quiet_s` CPU seconds over 20 ms (or
    `timeout_s` passed). A target's processes may still be busy with a slice's last requests
    when their answers are in (Redis applying the last writes, work the gateway does after
    answering); without this, that work would be counted in the next target's slice."""
    deadline = time.monotonic() + timeout_s
    before = _cpu_s(pids)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        now = _cpu_s(pids)
        if now - before < quiet_s:
            return
        before = now


async def level(
    urls: dict[str, str],
    pids: dict[str, list[int]],
    order: list[str],
    concurrency: int,
    n: int,
    slices: int,
    slice_min: int = 0,
) -> dict[str, dict[str, float]]:
    """One round of the targets `order` at one concurrency: each target warmed up, then `n`
    timed requests each, sent in `slices` slices taken in turn (target 1's first slice, target
    2's, ..., target 1's second, ...), so a change in the machine's load meets every target
    alike. Per target: requests/s, latency percentiles (ms), errors and CPU ms per request of
    its `pids`, summed over its slices. Each slice is at least `slice_min` times
    `concurrency` requests (`slice_sizes`) and follows `concurrency` untimed requests of its
    own target, so the connections it uses are open and every worker is busy when its clock
    starts."""
    sizes = slice_sizes(n, slices, concurrency, slice_min)
    # latencies, errors, wall s, cpu s, the part of it in Redis (a target's pids after the first)
    acc = {t: ([], [0], [0.0], [0.0], [0.0]) for t in order}
    async with contextlib.AsyncExitStack() as stack:
        drivers = {t: await stack.enter_async_context(Driver(urls[t], concurrency)) for t in order}
        for t in order:
            warm = await _paths(drivers[t], t, 2 * concurrency)
            await drivers[t].drain(warm, _body(t))
        everyone = sorted({pid for t in order for pid in pids[t]})
        for size in sizes:
            for t in order:
                timed = await _paths(drivers[t], t, size)
                if slice_min:  # 0: the method before, for an A/A check of it
                    await drivers[t].drain(await _paths(drivers[t], t, concurrency), _body(t))
                await settle(everyone)  # the previous slice's leftover work counted there
                cpu0, t0 = _cpu_s(pids[t]), time.perf_counter()
                redis0 = _cpu_s(pids[t][1:])
                latencies, errors = await drivers[t].drain(timed, _body(t))
                lat, err, wall, cpu, redis_cpu = acc[t]
                wall[0] += time.perf_counter() - t0
                await settle(everyone)  # work a request leaves after its answer: this slice's
                cpu[0] += _cpu_s(pids[t]) - cpu0
                redis_cpu[0] += _cpu_s(pids[t][1:]) - redis0
                lat += latencies
                err[0] += errors
    return {
        t: _stats(lat, err[0], wall[0], cpu[0], redis_cpu[0])
        for t, (lat, err, wall, cpu, redis_cpu) in acc.items()
    }


def slice_sizes(n: int, slices: int, concurrency: int, slice_min: int = 0) -> list[int]:
    """The timed requests of each of a cell's `slices` slices: `n` split evenly, each raised to
    at least `slice_min` x `concurrency` (a slice shorter than that is mostly its ramp-up and
    drain, and at high concurrency so short in time that a collector pass or a timer's work in
    the target lands whole in one target's slice). Example: n 600, 2 slices, concurrency 64,
    slice_min 16 -> [1024, 1024] (600 / 2 = 300 < 16 x 64 = 1024); concurrency 1 -> [300, 300].
    """
    sizes = [n // slices + (1 if i < n % slices else 0) for i in range(slices)]
    return [max(size, slice_min * concurrency) for size in sizes]


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


async def measure(
    urls: dict[str, str],
    pids: dict[str, list[int]],
    n: int,
    rounds: int,
    slices: int = 1,
    levels: tuple[int, ...] = LEVELS,
    slice_min: int = 0,
) -> dict[tuple[str, int], dict[str, float]]:
    """Every target at every concurrency, `rounds` times (`level`; each round starts the
    targets one further along, so no target always follows the same one). Returns the best
    round (highest requests/s) per (target, concurrency); every round is kept in `ROUNDS`."""
    results: dict[tuple[str, int], dict[str, float]] = {}
    for r in range(rounds):  # interleaved, so drifting machine load hits every target alike
        shift = r % len(TARGETS)
        order = TARGETS[shift:] + TARGETS[:shift]
        for c in levels:
            got = await level(urls, pids, order, c, n, slices, slice_min)
            for t in TARGETS:
                key = (t, c)
                ROUNDS.setdefault(key, []).append(got[t])
                results[key] = best(results.get(key), got[t])
            print(
                f"  round {r + 1} at {c}: "
                + ", ".join(f"{t} {got[t]['cpu_ms']:.3f}" for t in TARGETS)
                + " cpu ms/req",
                file=sys.stderr,
                flush=True,
            )
    return results


def copies(wanted: list[str]) -> list[str]:
    """The A/A copies among `wanted` targets: each repeat of a name, numbered ("gateway#2",
    "gateway#3"). Example: ["gateway", "messages", "gateway"] -> ["gateway#2"]."""
    seen: dict[str, int] = {}
    out = []
    for t in wanted:
        seen[t] = seen.get(t, 0) + 1
        if seen[t] > 1:
            out.append(f"{t}#{seen[t]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="timed requests per cell")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--slices",
        type=int,
        default=4,
        help="each cell's timed requests are sent in this many slices, the targets' slices "
        "taken in turn within a round (1: each target's requests at once)",
    )
    parser.add_argument(
        "--slice-min",
        type=int,
        default=16,
        help="each slice holds at least this many times the concurrency in requests and "
        "follows as many untimed requests as the concurrency (default %(default)s: 1024 per "
        "slice at 64; 0: just --requests / --slices, no untimed requests before a slice)",
    )
    parser.add_argument(
        "--concurrency",
        default=",".join(map(str, LEVELS)),
        help="comma-separated concurrency levels (default: %(default)s)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave every process free to run on any CPU (default on 2+ CPUs: the proxies and "
        "gateways on the last CPU, the load driver, stub engine and Redis on the others)",
    )
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
    if args.slices < 1 or args.slices > args.requests:
        parser.error("--slices must be between 1 and --requests")
    if args.slice_min < 0:
        parser.error("--slice-min must be 0 or more")
    levels = tuple(int(c) for c in args.concurrency.split(","))
    if min(levels) < 1:
        parser.error("--concurrency levels must be 1 or more")
    cpus = None if args.no_pin else split_cpus()
    if cpus is not None:  # before any process starts: they inherit the load's CPUs
        pin(os.getpid(), cpus[0])
    ab = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.ab)} or None
    if ab is not None or args.compare_rev:
        TARGETS.extend(["gateway-B", "gateway-recorded-B", "responses-B"])
    if args.targets:
        wanted = args.targets.split(",")
        unknown = set(wanted) - set(TARGETS)
        if unknown:
            parser.error(f"unknown targets {sorted(unknown)}; known: {TARGETS}")
        TARGETS[:] = [t for t in TARGETS if t in wanted] + copies(wanted)
    procs: list[subprocess.Popen] = []
    redis = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-gw-") as tmp:
        try:
            source_b = export_rev(args.compare_rev, Path(tmp)) if args.compare_rev else None
            urls, redis, pids = start(procs, Path(tmp), ab, source_b, cpus and cpus[1])
            for t in TARGETS:  # A/A copies: the same server and processes, their own client
                urls[t], pids[t] = urls[base(t)], pids[base(t)]
            load = os.getloadavg()[0]
            started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            results = asyncio.run(
                measure(urls, pids, args.requests, args.rounds, args.slices, levels, args.slice_min)
            )
            print(
                f"{started}: {os.cpu_count()} CPUs, load average {load:.1f} at start; "
                f"{args.requests} requests per cell in {args.slices} slices (each at least "
                f"{args.slice_min} x the concurrency), best of "
                f"{args.rounds} rounds; "
                + (f"gateways on CPU {cpus[1]}, load on {cpus[0]}" if cpus else "not pinned")
                + (f"; gateway-recorded-B: {ab}" if ab else "")
                + (f"; gateway-recorded-B: {args.compare_rev}" if args.compare_rev else "")
            )
            print("\n".join(report(results, ROUNDS, TARGETS, levels, args.compare_rev)))
        finally:
            stop_all(procs, redis)
    return 0


if __name__ == "__main__":
    sys.exit(main())
