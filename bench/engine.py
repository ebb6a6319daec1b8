"""Output tokens/s of the embedded engine at concurrency 1, 8, 32, side by side with plain
transformers `generate` (batch = concurrency) and with one-request-at-a-time serving.

    .venv/bin/python bench/engine.py [--new-tokens 32] [--seconds 4] [--dtype float32]
    .venv/bin/python bench/engine.py --precision   # bf16 vs fp32 logprobs and decode speed

Three columns per concurrency c, all on the real SmolLM2-135M-Instruct, same prompt, greedy,
`ignore_eos` so every request produces exactly --new-tokens tokens:

* engine:   `python -m flywheel.engine` (continuous batching), c client threads sending
            /generate requests back to back over HTTP; tokens counted by the engine's own
            counter over a --seconds window;
* one-at-a-time: the same engine with max_batch_size 1 (requests served one after another),
            same c clients;
* generate: `model.generate` on a batch of c prompts in this process (no HTTP, no queue).

The engine processes run one after the other (never together) with the same torch thread
count as this process. Timings on a shared machine vary 10-30% run to run: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from flywheel.engine.convert import ensure_default_model

PROMPT = "<|im_start|>user\nWrite a short story about a robot learning to paint.<|im_end|>\n"
CONCURRENCY = (1, 8, 32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(
        self, dtype: str, max_batch: int, threads: int, settings: dict[str, str] | None = None
    ):
        """`settings`: further engine settings by name (FLYWHEEL_ENGINE__<NAME> values)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "FLYWHEEL_ENGINE__DTYPE": dtype,
            "FLYWHEEL_ENGINE__MAX_BATCH_SIZE": str(max_batch),
            "FLYWHEEL_ENGINE__BATCH_WAIT_MS": "5",
            "FLYWHEEL_ENGINE__THREADS": str(threads),
            **{f"FLYWHEEL_ENGINE__{k.upper()}": v for k, v in (settings or {}).items()},
        }
        cmd = [sys.executable, "-m", "flywheel.engine", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def __enter__(self) -> Engine:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"engine exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=30).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit("engine did not become healthy")

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def one(client: httpx.Client, url: str, new_tokens: int) -> int:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    r = client.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["meta_info"]["completion_tokens"])


def generated_tokens(url: str) -> float:
    """The engine's generated-token counter (Prometheus /metrics)."""
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("flywheel_engine_generated_tokens_total "):
            return float(line.split()[1])
    raise SystemExit("no flywheel_engine_generated_tokens_total in /metrics")


def serve(url: str, concurrency: int, new_tokens: int, seconds: float) -> float:
    """Output tokens/s while `concurrency` clients send requests back to back, measured over
    a fixed window with the engine's own token counter (so a cell never runs longer than
    the window); requests still running at the end are aborted before the next cell."""
    stop = threading.Event()

    def client() -> None:
        with httpx.Client() as c:
            while not stop.is_set():
                try:
                    one(c, url, new_tokens)
                except httpx.HTTPError:
                    return

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(min(1.0, seconds / 4))  # let the clients' first requests arrive
    before, t0 = generated_tokens(url), time.perf_counter()
    time.sleep(seconds)
    rate = (generated_tokens(url) - before) / (time.perf_counter() - t0)
    stop.set()
    httpx.post(f"{url}/abort_request", json={"abort_all": True}, timeout=60)
    for t in threads:
        t.join()
    return rate


def generate_rate(
    model_dir, dtype: str, concurrency: int, new_tokens: int, seconds: float
) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = tok([PROMPT] * concurrency, return_tensors="pt")
    produced, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        while True:
            out = model.generate(
                **ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
            produced += (out.shape[1] - ids["input_ids"].shape[1]) * concurrency
            if time.perf_counter() - t0 >= seconds:
                break
    return produced / (time.perf_counter() - t0)


PRECISION_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "What is 7 + 1? Answer with just the number.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into French.",
    "Why is the sky blue?",
    "Give me a haiku about autumn.",
    "What is the capital of Italy?",
]


def precision(model_dir, new_tokens: int) -> None:
    """bf16 vs fp32 on CPU: logprob differences on the same tokens, and decode speed.

    fp32 greedily generates `new_tokens` for 8 chat prompts; both precisions then score those
    exact tokens (prefill-only, logprob_start_len = len(prompt) - 1, the teacher recipe) and
    decode the same 8 rows as one batch (timed side by side).
    """
    import torch

    from flywheel.engine.batcher import decode_batch
    from flywheel.engine.protocol import RowSpec, SamplingParams
    from flywheel.engine.runner import ModelRunner
    from flywheel.engine.sequence import Job, Sequence

    runners = {d: ModelRunner(model_dir, d, device="cpu") for d in ("float32", "bfloat16")}
    tok = runners["float32"].tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PRECISION_PROMPTS
    ]
    prompt_ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]

    def seqs(runner, ids_list, max_new, start=-1):
        out = []
        for ids in ids_list:
            params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
            spec = RowSpec("p", None, ids, params, True, start, 0, False)
            s = Sequence(
                Job(spec),
                ids,
                max_new_tokens=max_new,
                eos_ids=runner.eos_ids,
                generator=torch.Generator(),
            )
            s.start()
            out.append(s)
        return out

    rates, scored = {}, {}
    for dtype, runner in runners.items():
        batch = seqs(runner, prompt_ids, new_tokens)
        t0 = time.perf_counter()
        decode_batch(runner, batch)
        rates[dtype] = len(batch) * new_tokens / (time.perf_counter() - t0)
        if dtype == "float32":
            full = [p + s.output_ids for p, s in zip(prompt_ids, batch, strict=True)]
            greedy32 = [s.output_ids for s in batch]
        else:
            greedy16 = [s.output_ids for s in batch]
    for dtype, runner in runners.items():
        rows = []
        for p, ids in zip(prompt_ids, full, strict=True):
            (s,) = seqs(runner, [ids], 0, start=len(p) - 1)
            decode_batch(runner, [s])
            rows.extend(s.input_logprobs[1:])
        scored[dtype] = torch.tensor(rows)
    diff = (scored["bfloat16"] - scored["float32"]).abs()
    same = sum(
        a == b for x, y in zip(greedy32, greedy16, strict=True) for a, b in zip(x, y, strict=True)
    )
    print(
        f"bf16 vs fp32 on {len(diff)} scored tokens (8 prompts x {new_tokens} fp32-greedy "
        f"tokens): |dlogprob| mean {diff.mean():.4f} max {diff.max():.4f} nats; "
        f"greedy tokens equal {same}/{len(diff)}"
    )
    print(
        f"decode batch 8: fp32 {rates['float32']:.1f} tok/s, bf16 {rates['bfloat16']:.1f} "
        f"tok/s, bf16/fp32 {rates['bfloat16'] / rates['float32']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=4.0, help="per cell (bounded)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads everywhere")
    parser.add_argument(
        "--precision",
        action="store_true",
        help="instead: bf16 vs fp32 logprob differences and decode speed",
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    model_dir = ensure_default_model()
    if args.precision:
        precision(model_dir, args.new_tokens)
        return
    results: dict[str, dict[int, float]] = {"engine": {}, "one-at-a-time": {}, "generate": {}}
    for name, max_batch in (("engine", max(CONCURRENCY)), ("one-at-a-time", 1)):
        with Engine(args.dtype, max_batch, args.threads) as engine:
            serve(engine.url, 1, 4, 1.0)  # warm-up
            for c in CONCURRENCY:
                results[name][c] = serve(engine.url, c, args.new_tokens, args.seconds)
                print(f"  {name} c={c}: {results[name][c]:.1f} tok/s", flush=True)
    for c in CONCURRENCY:
        results["generate"][c] = generate_rate(
            model_dir, args.dtype, c, args.new_tokens, args.seconds
        )
        print(f"  generate batch={c}: {results['generate'][c]:.1f} tok/s", flush=True)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"SmolLM2-135M-Instruct {args.dtype}, {args.new_tokens} new tokens per request, "
        f"{args.threads} threads, ~{args.seconds:.0f} s per cell; output tokens/s "
        f"(load average at the end: {load} on {os.cpu_count()} CPUs)"
    )
    print(
        f"{'concurrency':>12} {'engine':>9} {'one-at-a-time':>14} {'generate':>9} "
        f"{'engine/one':>11} {'engine/generate':>16}"
    )
    for c in CONCURRENCY:
        e, o, g = (results[k][c] for k in ("engine", "one-at-a-time", "generate"))
        print(f"{c:>12} {e:>9.1f} {o:>14.1f} {g:>9.1f} {_ratio(e, o):>11} {_ratio(e, g):>16}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a (0 tok/s: raise --seconds)"


if __name__ == "__main__":
    main()
