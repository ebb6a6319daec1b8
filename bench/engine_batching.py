"""Tokens/s of the embedded engine: 8 requests one after another vs 8 at once (one batch).

Starts `python -m flywheel.engine` on the real converted SmolLM2-135M-Instruct (converting it
first if needed) on a free port, and drives it over HTTP like the gateway does.

    .venv/bin/python bench/engine_batching.py [--requests 8] [--new-tokens 64] [--dtype float32]

Numbers vary 10-30% run to run on a shared 2-core machine; compare the ratio, not absolutes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from flywheel.engine.convert import ensure_default_model

PROMPT = "<|im_start|>user\nWrite a short story about a robot learning to paint.<|im_end|>\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(port: int, dtype: str, max_batch: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "FLYWHEEL_ENGINE__DTYPE": dtype,
        "FLYWHEEL_ENGINE__MAX_BATCH_SIZE": str(max_batch),
        "FLYWHEEL_ENGINE__BATCH_WAIT_MS": "20",
    }
    cmd = [sys.executable, "-m", "flywheel.engine", "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
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


def one(url: str, seed: int, new_tokens: int) -> int:
    body = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
        "return_logprob": True,
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["meta_info"]["completion_tokens"])


def run(url: str, requests: int, new_tokens: int, concurrent: bool) -> float:
    t0 = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(requests) as pool:
            tokens = sum(pool.map(lambda s: one(url, s, new_tokens), range(requests)))
    else:
        tokens = sum(one(url, s, new_tokens) for s in range(requests))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds; the best of each mode counts"
    )
    args = parser.parse_args()

    ensure_default_model()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_engine(port, args.dtype, args.requests)
    try:
        wait_healthy(url, proc)
        one(url, 0, 8)  # warm-up
        sequential = batched = 0.0
        for _ in range(args.rounds):  # alternate, so a busy neighbour hurts both modes alike
            sequential = max(sequential, run(url, args.requests, args.new_tokens, False))
            batched = max(batched, run(url, args.requests, args.new_tokens, True))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"SmolLM2-135M {args.dtype}, {args.requests} requests x {args.new_tokens} new tokens")
    print(f"{'batch 1 (sequential)':>24}: {sequential:7.1f} tok/s")
    print(f"{f'batch {args.requests} (concurrent)':>24}: {batched:7.1f} tok/s")
    print(f"{'ratio':>24}: {batched / sequential:7.2f}x")


if __name__ == "__main__":
    main()
