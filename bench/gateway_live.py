"""Live-mode gateway load, as an OpenClaw-style harness makes it: `--agents` concurrent agents,
each running sessions of `--turns` turns through `X-Session-Id` (every turn extends the
conversation with the reply and a new user message, so each request stitches the recorded ids,
publishes the previous turn's Sample with its next state and stores the new turn), against the
instant stub engine; beside it, in the same run, the same number of unrecorded requests.

    .venv/bin/python bench/gateway_live.py [--agents 16] [--turns 4] [--sessions 10]
        [--compare-rev REV] [--rounds 1]

Prints requests/s, p50 latency and the CPU ms per request of the gateway plus Redis for both.
`--compare-rev REV` also runs the live sessions on the gateway of git revision REV (beside this
tree's, same Redis and stub, rounds interleaved; bench/gateway.py `export_rev`) and prints the
ratio of this tree's live CPU per request to REV's (best of `--rounds`). With `--together` the
two trees' live loads run at the same time instead of one after the other, so both meet the
same machine load (for a shared, busy machine); their CPU per request is then each gateway
process's own, without the Redis they share.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway as bench  # noqa: E402  (bench/gateway.py: process start-up and CPU reading)

CHAT = {"model": "m", "max_tokens": 8}


async def _agent(
    http: aiohttp.ClientSession,
    base: str,
    sessions: int,
    turns: int,
    live: bool,
    latencies: list[float],
) -> None:
    for _ in range(sessions):
        headers = {"X-Session-Id": uuid.uuid4().hex} if live else {}
        messages = [{"role": "user", "content": "What is 7 + 1?"}]
        for turn in range(turns):
            t0 = time.perf_counter()
            async with http.post(
                f"{base}/v1/chat/completions", headers=headers, json={**CHAT, "messages": messages}
            ) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {body}")
            latencies.append(time.perf_counter() - t0)
            messages = [
                *messages,
                body["choices"][0]["message"],
                {"role": "user", "content": f"And {turn} more?"},
            ]


async def run(
    base: str, pids: list[int], args: argparse.Namespace, live: bool, name: str = ""
) -> tuple[str, float]:
    """One load run: its report line and its CPU ms per request."""
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(
            *[_agent(http, base, 1, args.turns, live, []) for _ in range(args.agents)]
        )  # warm-up
        latencies: list[float] = []
        cpu0, t0 = bench._cpu_s(pids), time.perf_counter()
        await asyncio.gather(
            *[
                _agent(http, base, args.sessions, args.turns, live, latencies)
                for _ in range(args.agents)
            ]
        )
        wall, cpu = time.perf_counter() - t0, bench._cpu_s(pids) - cpu0
    latencies.sort()
    per = cpu * 1000 / len(latencies)
    label = name or ("live sessions" if live else "unrecorded")
    return (
        f"{label:<22}{len(latencies):>9}"
        f"{len(latencies) / wall:>9.0f}{latencies[len(latencies) // 2] * 1000:>9.1f}"
        f"{per:>11.2f}"
    ), per


async def _runs(
    urls: dict[str, str],
    pids: dict[str, list[int]],
    args: argparse.Namespace,
    group: tuple[tuple[str, bool, str], ...],
) -> list[tuple[str, float]]:
    """The runs of `group` at the same time (target, live, name each)."""
    # At the same time both would count the shared Redis's CPU: then the gateways' own only.
    key = (
        (lambda t: t) if len(group) > 1 else (lambda t: t.replace("gateway", "gateway-recorded", 1))
    )
    return await asyncio.gather(
        *[run(urls[t], pids[key(t)], args, live, name) for t, live, name in group]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=10, help="sessions per agent")
    parser.add_argument("--compare-rev", metavar="REV", default="")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (best kept)")
    parser.add_argument(
        "--together", action="store_true", help="with --compare-rev: both live loads at once"
    )
    args = parser.parse_args(argv)
    procs: list = []
    redis = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-live-") as tmp:
        try:
            rev = args.compare_rev
            source_b = bench.export_rev(rev, Path(tmp)) if rev else None
            urls, redis, pids = bench.start(procs, Path(tmp), source_b=source_b)
            runs = [("gateway", True, "live sessions"), ("gateway", False, "unrecorded")]
            if rev:
                runs.append(("gateway-B", True, f"live sessions, {rev}"))
            best: dict[str, tuple[str, float]] = {}
            ratios: list[float] = []
            for _ in range(args.rounds):  # interleaved: drifting load hits both trees alike
                if args.together and rev:
                    batch = [(runs[1],), (runs[0], runs[2])]
                else:
                    batch = [(r,) for r in runs]
                this: dict[str, float] = {}
                for group in batch:
                    for (_, _, name), got in zip(
                        group, asyncio.run(_runs(urls, pids, args, group)), strict=True
                    ):
                        this[name] = got[1]
                        if name not in best or got[1] < best[name][1]:
                            best[name] = got
                if rev:
                    ratios.append(this["live sessions"] / this[f"live sessions, {rev}"])
            lines = [best[name][0] for _, _, name in runs]
            if rev:
                a, b = best["live sessions"][1], best[f"live sessions, {rev}"][1]
                lines.append(
                    f"live CPU per request, this tree / {rev}: x{a / b:.2f} (best of each)"
                )
                each = ", ".join(f"x{r:.2f}" for r in ratios)
                lines.append(f"  per round: {each}; median x{statistics.median(ratios):.2f}")
        finally:
            for proc in procs:
                proc.kill()
            if redis is not None:
                redis.stop()
    print(f"{args.agents} agents x {args.sessions} sessions x {args.turns} turns")
    print(f"{'requests':<22}{'count':>9}{'req/s':>9}{'p50 ms':>9}{'cpu ms/req':>11}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
