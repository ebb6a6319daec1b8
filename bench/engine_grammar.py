"""Decode cost of constrained decoding on the embedded engine, side by side with free decoding.

    .venv/bin/python bench/engine_grammar.py [--new-tokens 32] [--rounds 3] [--batch 1 8]

One engine worker in this process serving the real SmolLM2-135M-Instruct (fp32). Per batch size
b and round, three kinds of b-row batches are run one after the other (interleaved, so machine
load hits them alike), each row producing exactly --new-tokens tokens (the grammars cannot
finish earlier and `ignore_eos` holds the free rows):

* free:  no grammar;
* regex: `regex` of 400 lowercase letters or spaces;
* json:  `json_schema` of an object with one string of at least 400 characters.

Prints output tokens/s per kind (sum over rounds) and each grammar's ratio to free decoding.
"""

from __future__ import annotations

import argparse
import json
import time

from flywheel.core.settings import EngineSettings
from flywheel.engine.convert import ensure_default_model
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.worker import EngineWorker

PROMPT = "<|im_start|>user\nWrite a short story about a robot.<|im_end|>\n<|im_start|>assistant\n"
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}
KINDS = {
    "free": {"ignore_eos": True},
    "regex": {"regex": "[a-z ]{400}"},
    "json": {"json_schema": json.dumps(STORY)},
}


def run_batch(worker: EngineWorker, ids: list[int], size: int, new_tokens: int, extra: dict) -> int:
    """Run one batch of `size` rows; returns the output tokens produced."""
    specs = [
        RowSpec(
            rid=f"b{time.monotonic_ns()}_{i}",
            text=None,
            input_ids=ids,
            params=SamplingParams(
                max_new_tokens=new_tokens, temperature=1.0, sampling_seed=i, **extra
            ),
            return_logprob=True,
            logprob_start_len=-1,
            top_logprobs_num=0,
            return_text_in_logprobs=False,
        )
        for i in range(size)
    ]
    jobs = worker.submit(specs)
    return sum(len(j.future.result(timeout=900)["output_ids"]) for j in jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    model = ensure_default_model()
    settings = EngineSettings(model_path=str(model), max_batch_size=64, batch_wait_ms=5)
    worker = EngineWorker(settings, model).start()
    assert worker.wait_ready(300), worker.error
    ids = worker.tokenizer.encode(PROMPT)
    try:
        for extra in KINDS.values():  # warm-up: compile each grammar once (cached)
            run_batch(worker, ids, 1, 2, extra)
        print(f"{args.new_tokens} new tokens per row, {args.rounds} rounds, tokens/s")
        print(
            f"{'batch':>5} | " + " | ".join(f"{k:>8}" for k in KINDS) + " | regex/free | json/free"
        )
        for size in args.batch:
            tokens = dict.fromkeys(KINDS, 0)
            seconds = dict.fromkeys(KINDS, 0.0)
            for _ in range(args.rounds):
                for kind, extra in KINDS.items():
                    t0 = time.perf_counter()
                    tokens[kind] += run_batch(worker, ids, size, args.new_tokens, extra)
                    seconds[kind] += time.perf_counter() - t0
            rate = {k: tokens[k] / seconds[k] for k in KINDS}
            cells = " | ".join(f"{rate[k]:8.1f}" for k in KINDS)
            print(
                f"{size:>5} | {cells} | {rate['regex'] / rate['free']:9.2f}x |"
                f" {rate['json'] / rate['free']:8.2f}x"
            )
    finally:
        worker.close()


if __name__ == "__main__":
    main()
