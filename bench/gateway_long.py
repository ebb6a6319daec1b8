"""Per-turn cost as a session grows: agents whose every turn adds a long tool result (an agent
reading files or search results), so the conversation reaches tens of thousands of tokens.

    .venv/bin/python bench/gateway_long.py [--agents 16] [--turns 40] [--tokens-per-turn 500]

Each agent runs one conversation of `--turns` turns against the instant stub engine; each turn
sends the whole conversation so far plus a new user message of about `--tokens-per-turn`
tokens (a tool result). Targets, side by side in one run, the same conversations:
- proxy: the pass-through proxy (bench/peers/passthrough.py) forwarding the chat request;
- gateway: unrecorded (renders and tokenizes the whole conversation every turn);
- gateway-recorded: through an episode session (renders the conversation, tokenizes only the
  new messages, stitches them onto the recorded ids and saves the record every turn);
- gateway-live: the same in a live session (header X-Session-Id): each turn also publishes the
  previous turn's Sample, the whole conversation so far, with its next state.
Prints the CPU ms per request of each target's processes (Redis included for the recorded one)
for each tenth of the turns, with the conversation's size there, and the ratios to the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway as bench  # noqa: E402  (bench/gateway.py: process start-up and CPU reading)

TARGETS = ["proxy", "gateway", "gateway-recorded", "gateway-live"]
WORDS = (
    "file",
    "line",
    "error",
    "value",
    "return",
    "config",
    "test",
    "module",
    "the",
    "of",
    "request",
    "import",
    "result",
    "user",
    "data",
    "path",
    "self",
    "list",
    "None",
    "int",
)


def tool_result(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of tool output (SmolLM2's tokenizer: about one token per word)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def _conversation(
    http: aiohttp.ClientSession,
    base: str,
    path: str,
    headers: dict,
    seed: int,
    turns: int,
    size: int,
    steps: list[asyncio.Event],
    done: list[asyncio.Event],
) -> None:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for turn in range(turns):
        await steps[turn].wait()
        messages.append({"role": "user", "content": tool_result(rng, size)})
        async with http.post(
            base + path, headers=headers, json={"model": "m", "messages": messages, "max_tokens": 8}
        ) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {body}")
        messages.append(body["choices"][0]["message"])
        done[turn].set()


async def run(base: str, target: str, pids: list[int], args: argparse.Namespace) -> list[float]:
    """CPU ms per request of `pids` for each turn (all agents take turn k together)."""
    async with aiohttp.ClientSession() as http:
        paths = ["/v1/chat/completions"] * args.agents
        if target.startswith("gateway-recorded"):
            paths = []
            for _ in range(args.agents):
                async with http.post(f"{base}/v1/sessions", json={"group_id": "long"}) as r:
                    paths.append(f"/s/{(await r.json())['session_id']}/v1/chat/completions")
        headers = [
            {"X-Session-Id": f"live-{a}-{time.time_ns()}"} if target == "gateway-live" else {}
            for a in range(args.agents)
        ]
        steps = [[asyncio.Event() for _ in range(args.turns)] for _ in range(args.agents)]
        done = [[asyncio.Event() for _ in range(args.turns)] for _ in range(args.agents)]
        agents = [
            asyncio.create_task(
                _conversation(
                    http,
                    base,
                    paths[a],
                    headers[a],
                    a,
                    args.turns,
                    args.tokens_per_turn,
                    steps[a],
                    done[a],
                )
            )
            for a in range(args.agents)
        ]
        per_turn = []
        for turn in range(args.turns):
            cpu0 = bench._cpu_s(pids)
            for a in range(args.agents):
                steps[a][turn].set()
            await asyncio.wait_for(
                asyncio.gather(*[done[a][turn].wait() for a in range(args.agents)]), 120
            )
            per_turn.append((bench._cpu_s(pids) - cpu0) * 1000 / args.agents)
        await asyncio.gather(*agents)
    return per_turn


def _ratio(num: float, den: float, width: int) -> str:
    """`num / den` as "x1.23" (CPU time is read in 10 ms ticks: "n/a" when `den` read 0)."""
    return f"{f'x{num / den:.2f}' if den > 0 else 'n/a':>{width}}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--tokens-per-turn", type=int, default=500)
    parser.add_argument("--only", choices=TARGETS, help="run one target (for profiling)")
    parser.add_argument(
        "--ab",
        metavar="KEY=JSON",
        action="append",
        default=[],
        help="also run a second gateway with this [gateway] setting (e.g. "
        "prefix_cache_mb=0): targets gateway-B, gateway-recorded-B",
    )
    args = parser.parse_args(argv)
    ab = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.ab)} or None
    targets = (args.only,) if args.only else TARGETS
    if ab is not None:
        TARGETS.extend(("gateway-B", "gateway-recorded-B"))
    procs: list = []
    redis = None
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-long-") as tmp:
        try:
            urls, redis, pids = bench.start(procs, Path(tmp), ab)
            urls["gateway-live"], pids["gateway-live"] = urls["gateway"], pids["gateway-recorded"]
            t0 = time.perf_counter()
            results = {t: asyncio.run(run(urls[t], t, pids[t], args)) for t in targets}
            if args.only:
                print(
                    f"{args.only}: CPU ms per request by turn: "
                    + " ".join(f"{ms:.1f}" for ms in results[args.only])
                )
                return 0
            wall = time.perf_counter() - t0
        finally:
            for proc in procs:
                proc.kill()
            if redis is not None:
                redis.stop()
    print(
        f"{args.agents} agents x {args.turns} turns, +{args.tokens_per_turn} tokens per turn "
        f"({wall:.0f} s); CPU ms per request, mean over each tenth of the turns"
        + (f"; gateway-B: {ab}" if ab else "")
    )
    print(
        f"{'turns':>9}{'~tokens':>9}"
        + "".join(f"{t:>19}" for t in TARGETS)
        + f"{'gateway/proxy':>15}{'recorded/proxy':>16}{'recorded/gateway':>18}"
        + f"{'live/gateway':>14}"
        + (f"{'B/gateway':>11}{'rec-B/rec':>11}" if ab else "")
    )
    tenth = max(args.turns // 10, 1)
    for start in range(0, args.turns, tenth):
        end = min(start + tenth, args.turns)
        mean = {t: sum(results[t][start:end]) / (end - start) for t in TARGETS}
        print(
            f"{start + 1:>4}-{end:<4}{end * args.tokens_per_turn:>9}"
            + "".join(f"{mean[t]:>19.2f}" for t in TARGETS)
            + _ratio(mean["gateway"], mean["proxy"], 15)
            + _ratio(mean["gateway-recorded"], mean["proxy"], 16)
            + _ratio(mean["gateway-recorded"], mean["gateway"], 18)
            + _ratio(mean["gateway-live"], mean["gateway"], 14)
            + (
                _ratio(mean["gateway-B"], mean["gateway"], 11)
                + _ratio(mean["gateway-recorded-B"], mean["gateway-recorded"], 11)
                if ab
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
