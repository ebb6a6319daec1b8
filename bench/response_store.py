"""CPU per stored response of the Responses API's store (api/responses_store.py), this tree's
against another git revision's, side by side in one run on one real Redis.

    .venv/bin/python bench/response_store.py --compare-rev REV [--puts 4000] [--rounds 5]

Each round runs both stores, in alternating order, through `--puts` `ResponseStore.put` calls
(a 1.5 KB stored value, the size of a short chat turn's) from `--concurrency` tasks on one
event loop (uvloop, as in the gateway), as the gateway's concurrent requests make them.
Reported: this process's CPU microseconds per put (packing, the pipelined write, reading and
settling the reply) and the Redis server's, best of the rounds and the median of the per-round
ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import psutil
import uvloop

ROOT = Path(__file__).resolve().parents[1]
MODULE = "services/flywheel/gateway/api/responses_store.py"
CONVERSATION = [
    {"role": "user", "content": "What is 7 + 1? " * 20},
    {"role": "assistant", "content": "It is 8. " * 20},
]
RESPONSE = {"id": "resp_x", "object": "response", "output": [{"text": "It is 8. " * 60}]}


def load_rev(rev: str, work: Path) -> ModuleType:
    """The store module as of git revision `rev` (imported under another name).

    Raises:
        subprocess.CalledProcessError: `rev` is not a revision of this repository.
    """
    source = subprocess.run(
        ["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = work / "responses_store_rev.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("responses_store_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def one_round(module: ModuleType, client: object, n: int, conc: int) -> float:
    """Seconds of this process's CPU for `n` puts from `conc` tasks (after a warm-up)."""
    store = module.ResponseStore(client, "bench", 600)
    stored = module.StoredResponse("key", "", CONVERSATION)
    body = module.dumps(RESPONSE)
    todo = list(range(n))

    async def worker() -> None:
        while todo:
            i = todo.pop()
            await store.put(f"resp_{i}", stored, body)

    await asyncio.gather(*(store.put(f"warm_{i}", stored, body) for i in range(conc)))
    cpu0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.process_time() - cpu0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare-rev", required=True, metavar="REV")
    parser.add_argument("--puts", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "services"))
    from flywheel.core.redis_client import connect  # noqa: PLC0415
    from flywheel.core.redis_server import LocalRedis  # noqa: PLC0415
    from flywheel.gateway.api import responses_store  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="flywheel-bench-store-") as tmp:
        other = load_rev(args.compare_rev, Path(tmp))
        redis = LocalRedis(Path(tmp) / "redis").start()
        try:
            server = psutil.Process(redis.proc.pid)
            client = connect(redis.url, socket_timeout=10)
            cpu: dict[str, list[tuple[float, float]]] = {"this tree": [], args.compare_rev: []}
            mods = {"this tree": responses_store, args.compare_rev: other}
            for r in range(args.rounds):
                order = list(mods) if r % 2 == 0 else list(mods)[::-1]
                for name in order:
                    s0 = sum(server.cpu_times()[:2])
                    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                        own = runner.run(one_round(mods[name], client, args.puts, args.concurrency))
                    red = sum(server.cpu_times()[:2]) - s0
                    cpu[name].append((own * 1e6 / args.puts, red * 1e6 / args.puts))
        finally:
            redis.stop()
    print(
        f"{args.puts} puts per round from {args.concurrency} tasks, {args.rounds} rounds; "
        "CPU us per put (best round):"
    )
    for name, rows in cpu.items():
        own, red = min(r[0] for r in rows), min(r[1] for r in rows)
        print(f"  {name:<12} client {own:7.1f}  redis {red:6.1f}")
    a, b = cpu["this tree"], cpu[args.compare_rev]
    each = [x[0] / y[0] for x, y in zip(a, b, strict=True)]
    print(
        f"this tree / {args.compare_rev} (client CPU per put): best x"
        f"{min(r[0] for r in a) / min(r[0] for r in b):.2f}, median of rounds x"
        f"{statistics.median(each):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
