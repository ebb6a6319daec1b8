"""Live-mode gateway load, as an OpenClaw-style harness makes it: `--agents` concurrent agents,
each running sessions of `--turns` turns through `X-Session-Id` (every turn extends the
conversation with the reply and a new user message, so each request stitches the recorded ids,
publishes the previous turn's Sample with its next state and stores the new turn), against the
instant stub engine; beside it, in the same run, the same number of unrecorded requests.

    .venv/bin/python bench/gateway_live.py [--agents 16] [--turns 4] [--sessions 10]

Prints requests/s, p50 latency and the CPU ms per request of the gateway plus Redis for both.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def run(base: str, pids: list[int], args: argparse.Namespace, live: bool) -> str:
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
    return (
        f"{'live sessions' if live else 'unrecorded':<14}{len(latencies):>9}"
        f"{len(latencies) / wall:>9.0f}{latencies[len(latencies) // 2] * 1000:>9.1f}"
        f"{cpu * 1000 / len(latencies):>11.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=10, help="sessions per agent")
    args = parser.parse_args(argv)
    procs: list = []
    redis = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-live-") as tmp:
        try:
            urls, redis, pids = bench.start(procs, Path(tmp))
            lines = [
                asyncio.run(run(urls["gateway"], pids["gateway-recorded"], args, live))
                for live in (True, False)
            ]
        finally:
            for proc in procs:
                proc.kill()
            if redis is not None:
                redis.stop()
    print(f"{args.agents} agents x {args.sessions} sessions x {args.turns} turns")
    print(f"{'requests':<14}{'count':>9}{'req/s':>9}{'p50 ms':>9}{'cpu ms/req':>11}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
