"""Streamed chat answers: time to the first content, whole-answer time and gateway CPU of the
same episode turns sent with `stream: true` (answered as sampled) and without (answered whole),
side by side in one run against the real engine (SmolLM2-135M-Instruct on the CPU).

    .venv/bin/python bench/gateway_stream.py [--requests 12] [--max-tokens 64]
                                             [--stream-interval 1]

Requests alternate between the two ways, one at a time, each in a new episode session; every
request asks for exactly `--max-tokens` tokens at temperature 1 with its own seed (the same
seeds for both ways). Prints medians and the ratios streamed / whole.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from flywheel.core.redis_server import LocalRedis
from flywheel.core.settings import load_settings
from flywheel.engine.convert import ensure_default_model
from flywheel.ops.stack import Stack

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _one(
    gateway: str, pid: int, seed: int, stream: bool, max_tokens: int
) -> tuple[float, float, float, int]:
    """(seconds to the first content, seconds to the end, gateway CPU seconds, tokens)."""
    session = httpx.post(f"{gateway}/v1/sessions", json={"group_id": f"bench-{seed}"}).json()
    body = {
        "model": "m",
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream(
        "POST", f"{session['base_url']}/chat/completions", json=body, timeout=300
    ) as reply:
        for line in reply.iter_lines():
            if first is None and ('"content": "' in line and '"content": ""' not in line):
                first = time.perf_counter() - t0
            if '"usage"' in line or '"completion_tokens"' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
    end = time.perf_counter() - t0
    cpu = _cpu_s(pid) - cpu0
    httpx.post(f"{gateway}/v1/sessions/{session['session_id']}/finish", json={"reward": 0.0})
    return (end if first is None else first), end, cpu, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="gateway.stream_interval (tokens per engine stream chunk)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state, LocalRedis(Path(state) / "redis") as redis:
        settings = load_settings(
            redis={"url": redis.url},
            streams={"prefix": "bench"},
            state_dir=state,
            engine={"model_path": str(ensure_default_model()), "port": 31890},
            gateway={"port": 8990, "stream_interval": args.stream_interval},
        )
        with Stack(settings, echo=lambda *_: None, only=("engine", "gateway")) as running:
            gateway = next(s for s in running.services if s.name == "gateway")
            url, pid = gateway.url, gateway.proc.pid
            _one(url, pid, 0, True, 8)  # warm-up
            _one(url, pid, 0, False, 8)
            rows: dict[bool, list[tuple[float, float, float, int]]] = {True: [], False: []}
            for i in range(args.requests):
                for stream in (i % 2 == 0, i % 2 == 1):
                    rows[stream].append(_one(url, pid, 1000 + i, stream, args.max_tokens))
    print(
        f"{args.requests} requests each way, {args.max_tokens} max tokens, one at a time, "
        f"stream_interval {args.stream_interval}"
    )
    print(
        f"{'':<10}{'first content s':>16}{'whole answer s':>16}{'gateway CPU ms':>16}{'tokens':>8}"
    )
    med = {k: [statistics.median(r[j] for r in v) for j in range(4)] for k, v in rows.items()}
    for stream, name in ((True, "streamed"), (False, "whole")):
        m = med[stream]
        print(f"{name:<10}{m[0]:>16.3f}{m[1]:>16.3f}{m[2] * 1000:>16.1f}{m[3]:>8.0f}")
    s, w = med[True], med[False]
    print(f"{'streamed / whole':<10}{s[0] / w[0]:>9.2f}x{s[1] / w[1]:>15.2f}x{s[2] / w[2]:>15.2f}x")


if __name__ == "__main__":
    sys.exit(main())
