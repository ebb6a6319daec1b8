"""Reward service throughput: samples scored per second with m = 1, 3, 5 judge votes, against
an instant judge (the service's own overhead) and against the embedded engine serving
SmolLM2-135M-Instruct behind its OpenAI endpoint, in one run.

    .venv/bin/python bench/reward.py [--instant-samples 200] [--engine-samples 4]
                                     [--max-tokens 32] [--in-flight 16] [--skip-engine]

Parts, each over real HTTP (and real Redis for the stream path):
1. instant judge (flywheel.reward.fake_judge: answers at once), per m:
   - raw: the m judge calls of a sample made directly with the client, no scoring;
   (each rate is the best of `--rounds` interleaved repetitions)
   - scorer: Scorer.score (render, m concurrent votes, parse, aggregate, combine);
   - stream: the RewardWorker path (XREADGROUP -> score -> XADD -> XACK) on a local Redis.
   Wall rates (samples/s) swing with other load on a shared machine; the CPU time this
   process spends per sample (the judge runs in its own process) does not, so the service's
   overhead is reported as stream CPU ms/sample - raw CPU ms/sample.
2. embedded engine (SmolLM2 at `--max-tokens` per vote): samples/s of Scorer.score per m, with
   `--engine-samples` samples in flight together (bounded run).
Numbers vary run to run on a shared 2-core machine; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from flywheel.core.codec import new_sample
from flywheel.core.judge_client import AsyncJudgeClient, judge_metrics
from flywheel.core.redis_client import connect
from flywheel.core.redis_server import LocalRedis, free_port
from flywheel.core.streams import StreamConsumer, StreamProducer
from flywheel.reward.judge import NextStateJudge
from flywheel.reward.parsing import parse_verdict
from flywheel.reward.scoring import Scorer
from flywheel.reward.worker import RewardWorker

VOTES = (1, 3, 5)


def turn(i: int):
    s = new_sample(sample_id=f"s{i}", mode="live", task_json=json.dumps({"answer": 5}))
    s.messages.add(role="user", content_json=json.dumps("What is 2 + 3?"))
    s.messages.add(role="assistant", content_json=json.dumps("2 + 3 = 5."))
    s.next_state.role = "user"
    s.next_state.content_json = json.dumps("Great, thanks! That is right.")
    return s


def scorer_for(
    url: str, model: str, votes: int, in_flight: int, max_tokens: int = 32, timeout_s: float = 30.0
) -> Scorer:
    client = AsyncJudgeClient(
        url,
        model,
        max_concurrency=in_flight * votes,
        max_attempts=1,
        timeout_s=timeout_s,
        max_tokens=max_tokens,
        metrics=judge_metrics("reward"),
    )
    return Scorer("last_integer", judge=NextStateJudge(client, "prm_v2", votes=votes))


async def bounded(n: int, in_flight: int, job) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to run job(i) for i < n, `in_flight` at
    once."""
    slots = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with slots:
            await job(i)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - start, time.process_time() - cpu


async def raw_rate(url: str, votes: int, n: int, in_flight: int) -> tuple[float, float]:
    client = AsyncJudgeClient(
        url,
        "fake",
        max_concurrency=in_flight * votes,
        max_attempts=1,
        metrics=judge_metrics("reward"),
    )
    prompt = NextStateJudge(client, "prm_v2", votes).render(
        context="user: What is 2 + 3?",
        response="2 + 3 = 5.",
        next_state="Great, thanks!",
        next_role="user",
        response_status="complete",
    )

    async def job(_i: int) -> None:
        await asyncio.gather(*(client.vote(prompt, parse_verdict) for _ in range(votes)))

    await job(0)  # warm the connection pool
    wall, cpu = await bounded(n, in_flight, job)
    await client.aclose()
    return n / wall, cpu / n


async def scorer_rate(scorer: Scorer, n: int, in_flight: int) -> tuple[float, float]:
    async def job(i: int) -> None:
        sample = await scorer.score(turn(i))
        assert sample.has_reward, sample.error

    await job(0)
    wall, cpu = await bounded(n, in_flight, job)
    return n / wall, cpu / n


async def stream_rate(
    client, prefix: str, scorer: Scorer, n: int, in_flight: int
) -> tuple[float, float]:
    src = StreamProducer(client, f"{prefix}:rollouts")
    consumer = StreamConsumer(
        client, f"{prefix}:rollouts", "reward", "bench", dead_stream=f"{prefix}:dead"
    )
    worker = RewardWorker(
        consumer,
        StreamProducer(client, f"{prefix}:train"),
        scorer,
        block_ms=100,
        max_in_flight=in_flight,
    )
    for i in range(n):
        src.publish(turn(i))
    start, cpu = time.perf_counter(), time.process_time()
    while client.xlen(f"{prefix}:train") < n:
        await worker.step()
    await worker.drain()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert client.xpending(f"{prefix}:rollouts", "reward")["pending"] == 0
    return n / wall, cpu / n


def instant_part(n: int, in_flight: int, rounds: int) -> list[tuple[int, list[float], list[float]]]:
    port = free_port(18700)
    # its own process, so the judge's threads do not share this process's GIL
    judge = subprocess.Popen(
        [sys.executable, "-m", "flywheel.reward.fake_judge", str(port)], stdout=subprocess.PIPE
    )
    url = judge.stdout.readline().decode().strip()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp)) as redis_server:
            client = connect(redis_server.url)
            for m in VOTES:
                rate, cpu = [0.0] * 3, [float("inf")] * 3
                for r in range(rounds):  # interleaved; the best of each is the least disturbed
                    runs = (
                        asyncio.run(raw_rate(url, m, n, in_flight)),
                        asyncio.run(
                            scorer_rate(scorer_for(url, "fake", m, in_flight), n, in_flight)
                        ),
                        asyncio.run(
                            stream_rate(
                                client,
                                f"bench{m}-{r}",
                                scorer_for(url, "fake", m, in_flight),
                                n,
                                in_flight,
                            )
                        ),
                    )
                    rate = [max(a, b[0]) for a, b in zip(rate, runs, strict=True)]
                    cpu = [min(a, b[1]) for a, b in zip(cpu, runs, strict=True)]
                rows.append((m, rate, cpu))
    finally:
        judge.terminate()
        judge.wait(timeout=10)
    return rows


def engine_part(n: int, max_tokens: int, report=print) -> list[tuple[int, float, float]]:
    from flywheel.engine.convert import ensure_default_model  # noqa: PLC0415

    model = ensure_default_model()
    port = free_port(31700)
    env = {**os.environ, "FLYWHEEL_ENGINE__BATCH_WAIT_MS": "20"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.engine", "--model-path", str(model), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not start in 300 s")
            time.sleep(0.5)
        model_name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        for m in VOTES:
            scorer = scorer_for(f"{base}/v1", model_name, m, n, max_tokens, timeout_s=300)
            samples = [turn(i) for i in range(n)]

            async def run(scorer=scorer, samples=samples):
                start = time.perf_counter()
                await asyncio.gather(*(scorer.score(s) for s in samples))
                return time.perf_counter() - start

            seconds = asyncio.run(run())
            valid = sum(v.has_value for s in samples for v in s.votes)
            rows.append((m, n / seconds, valid / (n * m)))
            rate = n / seconds
            report(f"{m:>2} {rate:>10.3f} {rate / rows[0][1]:>7.2f} {valid / (n * m):>17.2f}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instant-samples", type=int, default=200)
    parser.add_argument("--engine-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved repetitions of the instant part; best of each kept",
    )
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-instant", action="store_true")
    args = parser.parse_args()

    if not args.skip_instant:
        print(
            f"instant judge, {args.instant_samples} samples, {args.in_flight} in flight, best of "
            f"{args.rounds}; rates in samples/s (raw = the m calls alone)"
        )
        print(
            f"{'m':>2} | {'samples/s: raw':>14} {'scorer':>8} {'stream':>8} | "
            f"{'CPU ms/sample: raw':>18} {'scorer':>7} {'stream':>7} | {'overhead CPU ms':>15}"
            f" {'stream/raw CPU':>14}"
        )
        sys.stdout.flush()
        for m, rate, cpu in instant_part(args.instant_samples, args.in_flight, args.rounds):
            ms = [c * 1000 for c in cpu]
            print(
                f"{m:>2} | {rate[0]:>14.1f} {rate[1]:>8.1f} {rate[2]:>8.1f} | "
                f"{ms[0]:>18.2f} {ms[1]:>7.2f} {ms[2]:>7.2f} | {ms[2] - ms[0]:>15.2f}"
                f" {ms[2] / ms[0]:>14.2f}"
            )
    if args.skip_engine:
        return
    print(
        f"\nembedded engine (SmolLM2-135M), {args.engine_samples} samples together, "
        f"{args.max_tokens} tokens per vote"
    )
    print(f"{'m':>2} {'samples/s':>10} {'vs m=1':>7} {'valid vote share':>17}")
    engine_part(args.engine_samples, args.max_tokens, report=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
