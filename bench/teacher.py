"""Teacher scoring throughput: scored response tokens per second on the embedded engine, the same
requests sent one by one vs coalesced into batched /generate calls, in one run.

Starts `python -m flywheel.engine` on the real SmolLM2-135M-Instruct (converted first if needed)
on a free port and scores with `flywheel.teacher.scoring.TeacherScorer`, as the teacher service
does: each request is a chat prompt (teacher tokenizer, with a hint) + a response of exact ids,
prefill only (`max_new_tokens: 0`, `logprob_start_len = len(prompt) - 1`).

Modes (rounds alternate, so a busy neighbour hurts every mode alike; the best round counts):
- one by one: `max_batch 1`, one call in flight: each request waits for the previous one;
- concurrent: `max_batch 1`, 4 calls in flight (the engine's own scheduler may group them);
- batched: all requests submitted at once, coalesced up to `--batch` per /generate call.

    .venv/bin/python bench/teacher.py [--requests 16] [--response-tokens 64] [--batch 16]

Numbers vary 10-30% run to run on a shared 2-core machine; compare the ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from flywheel.engine.convert import ensure_default_model
from flywheel.teacher.context import TeacherRenderer, insert_context
from flywheel.teacher.scoring import TeacherScorer

TEXT = (
    "The robot looked at the blank canvas for a long time before it lifted the brush. It had "
    "read every book about painting in the library, measured the angles of ten thousand "
    "brush strokes and learned the names of all the colours, yet it did not know where to "
    "begin. So it began with a single blue line, and then another, and slowly a river "
    "appeared, winding through hills that were not there a moment ago. "
) * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(port: int, max_batch: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "FLYWHEEL_ENGINE__MAX_BATCH_SIZE": str(max_batch),
        "FLYWHEEL_ENGINE__BATCH_WAIT_MS": "5",
    }
    cmd = [sys.executable, "-m", "flywheel.engine", "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("engine did not become healthy")


def requests_for(
    renderer: TeacherRenderer, n: int, response_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """n (teacher prompt ids, response ids) pairs of different prompt lengths."""
    ids = renderer.tokenizer.encode(TEXT, add_special_tokens=False)
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Tell story number {i} about a robot" + "!" * i}]
        prompt = renderer.prompt_ids(insert_context(msgs, "Keep it calm.", "last_user"))
        out.append((prompt, ids[i : i + response_tokens]))
    return out


def run(url: str, reqs: list, max_batch: int, in_flight: int, batch_wait_ms: float) -> float:
    """Scored response tokens per second for all `reqs` submitted at once."""
    scorer = TeacherScorer(
        [url],
        max_batch=max_batch,
        batch_wait_ms=batch_wait_ms,
        max_concurrency=in_flight,
        timeout_s=600,
    )
    try:
        t0 = time.perf_counter()
        futures = [scorer.submit(p, r) for p, r in reqs]
        tokens = sum(len(f.result().logprobs) for f in futures)
        return tokens / (time.perf_counter() - t0)
    finally:
        scorer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="max requests per /generate")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the engine on `timeout`
    model = ensure_default_model()
    renderer = TeacherRenderer(model)
    reqs = requests_for(renderer, args.requests, args.response_tokens)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_engine(port, max(args.batch, 4))
    modes = {
        "one by one": (1, 1, 0.0),
        "concurrent (4 in flight)": (1, 4, 0.0),
        f"batched (<= {args.batch} per call)": (args.batch, 1, 20.0),
    }
    best = dict.fromkeys(modes, 0.0)
    try:
        wait_healthy(url, proc)
        print("engine ready", file=sys.stderr, flush=True)
        run(url, reqs[:2], 1, 1, 0.0)  # warm-up
        for _ in range(args.rounds):
            for name, (max_batch, in_flight, wait) in modes.items():
                value = run(url, reqs, max_batch, in_flight, wait)
                print(f"  {name}: {value:.1f} scored tok/s", file=sys.stderr, flush=True)
                best[name] = max(best[name], value)
    finally:
        proc.terminate()
        proc.wait(30)
    prompt_tokens = sum(len(p) for p, _ in reqs) / len(reqs)
    print(
        f"SmolLM2-135M fp32, {args.requests} requests x {args.response_tokens} response tokens"
        f" (prompts {prompt_tokens:.0f} tokens on average), best of {args.rounds} rounds"
    )
    base = best["one by one"]
    for name, value in best.items():
        print(f"{name:>28}: {value:8.1f} scored tok/s  ({value / base:5.2f}x)")


if __name__ == "__main__":
    main()
