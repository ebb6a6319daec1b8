"""Does a weight push stall serving? The real engine (SmolLM2-135M-Instruct on the CPU) streams
`--rows` long generations; while they run, the weights are pushed with
`/update_weights_from_disk` (the trainer's disk push: a `weights/v_<n>` folder of the same
model), and a short request is sent `--probe-after-s` seconds after the push began.

    .venv/bin/python bench/push_stall.py [--rows 4] [--new-tokens 160]

Runs three ways side by side: the engine's default `engine.weight_swap = "step"` (the swap lands
between two decode steps; rows in flight continue under the new weights), and on an engine with
`weight_swap = "drain"` (the swap waits until the rows in flight finish on the old weights) both
`trainer.push.pause = "none"` and `"in_place"` (pause in place, update, continue). Prints, against
the median gap between two streamed chunks before the push (one decode step): the longest gap in
token output of the busy rows while the push ran, the push's own duration, and the time to the
first token of the request sent during the push (with the same request's time on an idle engine
beside it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from engine import Engine  # noqa: E402  (bench/engine.py)

from flywheel.engine.convert import ensure_default_model  # noqa: E402
from flywheel.trainer.weights import WeightPusher, WeightsStore  # noqa: E402


def stream_row(url: str, new_tokens: int, seed: int, stamps: list[float]) -> None:
    """One streamed /generate row; appends the arrival time of each chunk to `stamps`."""
    body = {
        "text": "Tell me a long story about a lighthouse keeper.",
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                stamps.append(time.perf_counter())


def first_token_s(url: str) -> float:
    """Seconds to the first streamed chunk of a 2-token request."""
    stamps: list[float] = []
    t0 = time.perf_counter()
    stream_row(url, 2, 7, stamps)
    return stamps[0] - t0


def measure(url: str, folder: Path, version: int, pause: str, args: argparse.Namespace) -> dict:
    """Busy rows, a push with `pause`, and a short request sent during it; the numbers."""
    stamps: list[list[float]] = [[] for _ in range(args.rows)]
    rows = [
        threading.Thread(target=stream_row, args=(url, args.new_tokens, i, stamps[i]))
        for i in range(args.rows)
    ]
    for t in rows:
        t.start()
    while min(len(s) for s in stamps) < 20:  # every row is decoding
        time.sleep(0.05)
    pusher = WeightPusher([url], timeout_s=600, attempts=1, pause=pause)
    ttft: list[float] = []
    push_start = time.perf_counter()
    thread = threading.Thread(target=pusher.push, args=(folder, version))
    thread.start()
    time.sleep(args.probe_after_s)  # the push has reached the engine
    probe = threading.Thread(target=lambda: ttft.append(first_token_s(url)))
    probe.start()
    thread.join()
    push_end = time.perf_counter()
    probe.join()
    for t in rows:
        t.join()
    served = httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"]
    if served != str(version):
        raise SystemExit(f"push of version {version} did not take: the engine serves {served}")
    before = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b < push_start]
    during = [
        b - a
        for s in stamps
        for a, b in zip(s, s[1:], strict=False)
        if b > push_start and a < push_end
    ]
    return {
        "step_ms": statistics.median(before) * 1000,
        "push_s": push_end - push_start,
        "gap_ms": max(during, default=0.0) * 1000,
        "ttft_s": ttft[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument(
        "--probe-after-s", type=float, default=0.5, help="the short request's delay after the push"
    )
    args = parser.parse_args()
    model = ensure_default_model()
    rows = {}
    modes = (("step", "none"), ("drain", "none"), ("drain", "in_place"))
    idle_ttft = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = WeightsStore(Path(tmp), model).write(1, load_file(model / "model.safetensors"))
        for swap in ("step", "drain"):
            with Engine("float32", 16, 0, {"weight_swap": swap}) as engine:
                idle_ttft = idle_ttft or first_token_s(engine.url)
                for version, (mode, pause) in enumerate(modes, start=1):
                    if mode == swap:
                        rows[f"{swap}/{pause}"] = measure(engine.url, folder, version, pause, args)
    print(
        f"{'swap/pause':16} {'decode step':>12} {'push':>8} {'longest gap':>12} {'gap/step':>9}"
        f" {'first token of a request sent during the push':>47}"
    )
    for name, r in rows.items():
        print(
            f"{name:16} {r['step_ms']:>9.1f} ms {r['push_s']:>6.2f} s {r['gap_ms']:>9.1f} ms"
            f" {r['gap_ms'] / r['step_ms']:>8.1f}x {r['ttft_s']:>10.2f} s"
            f" (x{r['ttft_s'] / idle_ttft:.1f} of an idle engine's {idle_ttft:.2f} s)"
        )
    step = rows["step/none"]
    for name in ("drain/none", "drain/in_place"):
        other = rows[name]
        print(
            f"step / {name}: push x{step['push_s'] / other['push_s']:.2f}, longest gap"
            f" x{step['gap_ms'] / other['gap_ms']:.2f}, first token during the push"
            f" x{step['ttft_s'] / other['ttft_s']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
