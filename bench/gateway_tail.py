"""The gateway's latency tail side by side: this tree's gateway and git revision REV's, same stub
engine and Redis, interleaved rounds of unrecorded chat requests at one concurrency.

    .venv/bin/python bench/gateway_tail.py --compare-rev REV [--concurrency 64] \
        [--requests 300] [--rounds 8]

Per round and gateway: p50, p99 and max latency (ms) of `--requests` timed requests, and the
gateway process's CPU ms per request; then the median over rounds of each, and the ratio of this
tree's to REV's. Rounds alternate which gateway goes first. A tail that comes from pauses in the
gateway (a full garbage collection, the event loop blocked) shows as p99 and max far above p50
in some rounds; machine load moves p50 of both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gateway as bench  # bench/gateway.py: the same stub, Redis and gateway start-up
from request_loop import Driver  # bench/peers/request_loop.py (on the path by bench/gateway.py)


async def _round(url: str, pid: int, concurrency: int, n: int) -> dict[str, float]:
    async with Driver(url, concurrency) as client:
        await client.drain(["/v1/chat/completions"] * (2 * concurrency), bench.BODY)  # warm-up
        cpu0 = bench._cpu_s([pid])
        latencies, errors = await client.drain(["/v1/chat/completions"] * n, bench.BODY)
        cpu = bench._cpu_s([pid]) - cpu0
    lat = sorted(latencies) or [float("nan")]
    return {
        "p50": lat[len(lat) // 2] * 1000,
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000,
        "max": lat[-1] * 1000,
        "cpu_ms": cpu * 1000 / max(len(latencies), 1),
        "errors": errors,
    }


async def measure(
    urls: dict[str, str], pids: dict[str, list[int]], concurrency: int, n: int, rounds: int
) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"gateway": [], "gateway-B": []}
    for r in range(rounds):
        order = ["gateway", "gateway-B"] if r % 2 == 0 else ["gateway-B", "gateway"]
        for target in order:
            got = await _round(urls[target], pids[target][0], concurrency, n)
            out[target].append(got)
            print(
                f"  round {r} {target:<9}: p50 {got['p50']:7.1f}  p99 {got['p99']:7.1f}  "
                f"max {got['max']:7.1f} ms  cpu {got['cpu_ms']:.2f} ms/req",
                file=sys.stderr,
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare-rev", required=True, metavar="REV")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    procs: list[subprocess.Popen] = []
    redis = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-tail-") as tmp:
        try:
            source_b = bench.export_rev(args.compare_rev, Path(tmp))
            urls, redis, pids = bench.start(procs, Path(tmp), None, source_b)
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            runs = asyncio.run(measure(urls, pids, args.concurrency, args.requests, args.rounds))
            print(
                f"{os.cpu_count()} CPUs, load average {load:.1f} at start; concurrency "
                f"{args.concurrency}, {args.requests} requests x {args.rounds} rounds, "
                f"{time.monotonic() - t0:.0f} s; B = {args.compare_rev}"
            )
            print(f"{'gateway':<11}{'p50':>9}{'p99':>9}{'max':>9}{'cpu ms/req':>12}  (medians)")
            med = {
                t: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "max", "cpu_ms")}
                for t, rs in runs.items()
            }
            for t, m in med.items():
                print(
                    f"{t:<11}{m['p50']:>9.1f}{m['p99']:>9.1f}{m['max']:>9.1f}{m['cpu_ms']:>12.2f}"
                )
            for t, rs in runs.items():
                worst = max(rs, key=lambda r: r["p99"])
                print(
                    f"{t:<11}worst round: p50 {worst['p50']:.1f}, p99 {worst['p99']:.1f}, max "
                    f"{worst['max']:.1f} ms, cpu {worst['cpu_ms']:.2f} ms/req; rounds with p99 "
                    f"> 3 x p50: {sum(r['p99'] > 3 * r['p50'] for r in rs)} of {len(rs)}"
                )
            a, b = med["gateway"], med["gateway-B"]
            print(
                "this tree / B: "
                + ", ".join(f"{k} x{a[k] / b[k]:.2f}" for k in ("p50", "p99", "max", "cpu_ms"))
                + f"; p99/p50 {a['p99'] / a['p50']:.2f} vs {b['p99'] / b['p50']:.2f}"
            )
        finally:
            bench.stop_all(procs, redis)
    return 0


if __name__ == "__main__":
    sys.exit(main())
