"""Load test of the local stack: N concurrent simulated agents for a fixed time, then the
end-to-end count identity.

    .venv/bin/python bench/load.py --agents 8 --duration 30

Starts a whole local stack (Redis, engine, gateway, reward, trainer as processes, loopback only)
on a tiny random-weight Llama with the real SmolLM2 tokenizer (`--model smollm2` for the real
135M model), then runs `--agents` asyncio agents with the official `openai` SDK. Each agent
loops over episodes until `--duration` seconds have passed: create a session, `--turns` chat
turns (the first offers a tool, every other one streams), then finish. Agents 2j and 2j+1
answer the same problem in the same group_id, so the trainer's groups of 2 fill. After the load
it waits (at most `--drain-s`) until every published Sample is accounted for and prints:

    requests/s, p50/p99 latency of chat turns, errors by status, Samples published, and
    published == trained + dead-lettered + dropped-with-metric (the count identity)

Bounded: at most `--agents` requests in flight, `--duration` + start-up + `--drain-s` seconds.
Exit status 0 when the identity holds and no request failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class Stats:
    def __init__(self) -> None:
        self.latencies_s: list[float] = []
        self.errors: Counter[str] = Counter()
        self.requests = 0
        self.episodes = 0
        self.reported_samples = 0


async def _turn(
    client: openai.AsyncOpenAI, messages: list[dict], turn: int, stats: Stats
) -> dict | None:
    kw: dict = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": 16,
        "temperature": 1.0,
    }
    if turn == 0:
        kw["tools"] = [TOOL]
    t0 = time.perf_counter()
    stats.requests += 1
    try:
        if turn % 2:
            text = []
            stream = await client.chat.completions.create(stream=True, **kw)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
            reply = {"role": "assistant", "content": "".join(text)}
        else:
            done = await client.chat.completions.create(**kw)
            msg = done.choices[0].message
            reply = {"role": "assistant", "content": msg.content or ""}
            if msg.tool_calls:
                reply["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
    except openai.APIStatusError as exc:
        stats.errors[str(exc.status_code)] += 1
        return None
    except openai.APIError as exc:
        stats.errors[type(exc).__name__] += 1
        return None
    stats.latencies_s.append(time.perf_counter() - t0)
    return reply


async def agent(i: int, gateway: str, deadline: float, turns: int, stats: Stats) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as http:
        k = 0
        while time.monotonic() < deadline:
            # agents 2j and 2j+1 share the group of their k-th episodes (groups of 2 fill)
            a, b = (i // 2 * 7 + k) % 10, (k * 3) % 10
            created = await http.post(
                "/v1/sessions", json={"group_id": f"g{k}-{i // 2}", "task": {"answer": a + b}}
            )
            stats.requests += 1
            if created.status_code != 200:
                stats.errors[f"sessions {created.status_code}"] += 1
                await asyncio.sleep(1.0)
                continue
            session = created.json()
            client = openai.AsyncOpenAI(
                base_url=session["base_url"], api_key="local", max_retries=0, timeout=120
            )
            messages = [{"role": "user", "content": f"What is {a} + {b}? Use the tool."}]
            for turn in range(turns):
                reply = await _turn(client, messages, turn, stats)
                if reply is None:
                    break
                messages.append(reply)
                if reply.get("tool_calls"):
                    messages.append(
                        {
                            "role": "tool",
                            "content": str(a + b),
                            "tool_call_id": reply["tool_calls"][0]["id"],
                        }
                    )
                else:
                    messages.append({"role": "user", "content": "Are you sure?"})
            done = await http.post(f"/v1/sessions/{session['session_id']}/finish", json={})
            stats.requests += 1
            if done.status_code == 200:
                stats.reported_samples += done.json()["samples_published"]
                stats.episodes += 1
            else:
                stats.errors[f"finish {done.status_code}"] += 1
            await client.close()
            k += 1


def _counts(redis_client, prefix: str, trainer_url: str) -> dict[str, int]:
    from flywheel.core.codec import decode_sample  # noqa: PLC0415
    from flywheel.core.streams import FIELD  # noqa: PLC0415
    from flywheel.trainer.groups import DropReason  # noqa: PLC0415

    status = httpx.get(f"{trainer_url}/status", timeout=10).json()
    dropped = status.get("samples_dropped", {})
    train_ids = [
        decode_sample(f[FIELD]).sample_id for _, f in redis_client.xrange(f"{prefix}:train")
    ]
    return {
        "published": redis_client.xlen(f"{prefix}:rollouts"),
        "scored": len(set(train_ids)),
        "trained": int(status.get("samples_trained", 0)),
        "dead_lettered": redis_client.xlen(f"{prefix}:dead"),
        # drops that dead-letter are already in the dead stream; a duplicate is a second copy
        # of a Sample (a reward retry after a crash), not a published Sample of its own
        "dropped_with_metric": sum(
            n
            for r, n in dropped.items()
            if r != DropReason.DUPLICATE and not DropReason(r).dead_letter
        ),
        "copies_in_train": len(train_ids) - len(set(train_ids)),
        "dropped_by_reason": dropped,
    }


def _identity(c: dict) -> bool:
    """published == trained + dead-lettered + dropped with a metric, and every extra copy in
    the train stream dropped as a duplicate (its own metric)."""
    return (
        c["published"] == c["trained"] + c["dead_lettered"] + c["dropped_with_metric"]
        and c["dropped_by_reason"].get("duplicate", 0) == c["copies_in_train"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--turns", type=int, default=2, help="chat turns per episode")
    parser.add_argument(
        "--drain-s",
        type=float,
        default=180.0,
        help="max seconds to wait for the pipeline to account for everything",
    )
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    args = parser.parse_args(argv)

    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.settings import load_settings  # noqa: PLC0415
    from flywheel.engine.convert import build_tiny_model, ensure_default_model  # noqa: PLC0415
    from flywheel.ops.stack import Stack  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="flywheel-load-"))
    model = build_tiny_model(work / "tiny") if args.model == "tiny" else ensure_default_model()
    prefix = "load"
    settings = load_settings(
        streams={"prefix": prefix, "block_ms": 200},
        engine={"model_path": str(model), "port": 31500, "batch_wait_ms": 10},
        gateway={"port": 8850, "default_max_tokens": 16},
        reward={"port": 50251, "metrics_port": 9251},
        trainer={
            "port": 8950,
            "batch": {"groups_per_step": 2, "group_size": 2, "group_wait_s": 3.0},
            "optim": {"lr": 1e-4},
            "checkpoint": {"dir": str(work / "ckpt")},
            "logging": {"metrics_path": str(work / "trainer_metrics.jsonl")},
        },
        state_dir=str(work / "state"),
    )
    print(f"starting the local stack in {work} ...", flush=True)
    with Stack(settings, echo=lambda line: print("  " + line, flush=True)) as stack:
        urls = {s.name: s.url for s in stack.services}
        stats = Stats()
        print(
            f"load: {args.agents} agents x {args.duration:g} s, {args.turns} turns/episode",
            flush=True,
        )
        t0 = time.monotonic()
        deadline = t0 + args.duration

        async def run() -> None:
            await asyncio.gather(
                *[
                    agent(i, urls["gateway"], deadline, args.turns, stats)
                    for i in range(args.agents)
                ]
            )

        asyncio.run(run())
        elapsed = time.monotonic() - t0
        client = connect(settings.redis_url())
        drain_end = time.monotonic() + args.drain_s
        counts = _counts(client, prefix, urls["trainer"])
        while not _identity(counts) and time.monotonic() < drain_end:
            time.sleep(2.0)
            counts = _counts(client, prefix, urls["trainer"])
        drained = time.monotonic() - t0 - elapsed
    lat = sorted(stats.latencies_s)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0)
    ok = _identity(counts) and not stats.errors and counts["published"] == stats.reported_samples
    report = {
        "agents": args.agents,
        "duration_s": round(elapsed, 1),
        "requests": stats.requests,
        "requests_per_s": round(stats.requests / elapsed, 2),
        "chat_turns": len(lat),
        "chat_p50_ms": round(p(0.50), 1),
        "chat_p99_ms": round(p(0.99), 1),
        "chat_mean_ms": round(statistics.fmean(lat) * 1000, 1) if lat else 0,
        "episodes": stats.episodes,
        "errors": dict(stats.errors),
        "samples_reported_by_finish": stats.reported_samples,
        **counts,
        "drain_s": round(drained, 1),
        "identity_holds": _identity(counts),
    }
    print(json.dumps(report, indent=2))
    print(
        f"published {counts['published']} = trained {counts['trained']} + dead-lettered "
        f"{counts['dead_lettered']} + dropped {counts['dropped_with_metric']}: "
        f"{'OK' if _identity(counts) else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
