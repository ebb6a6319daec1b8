"""Seconds and peak memory of one trainer optimizer step: chunked vs naive logprobs, side by side.

Each variant runs in a fresh subprocess (peak RSS is per process): load the model, build a batch
of GRPO groups, run one forward + backward of the logprobs over all micro-batches (its peak RSS
above the loaded model is the memory figure: activations, logits, gradients; no optimizer state
yet), then one warm-up optimizer step and `--repeats` timed ones. "naive" swaps the step's
logprob function for the full (B, T, V) float32 log-softmax; everything else is the trainer's
own `train_step`. Other processes on the machine skew the times: run it on an idle machine.

    .venv/bin/python bench/trainer_step.py                       # random 4-layer Llama, vocab 49152
    .venv/bin/python bench/trainer_step.py --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct
    .venv/bin/python bench/trainer_step.py --samples 32 --prompt 40 --completion 40 --micro-batch 8
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="HF model folder; empty = a random small Llama")
    p.add_argument("--samples", type=int, default=32, help="samples per step (groups of 8)")
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens per sample")
    p.add_argument("--completion", type=int, default=40, help="sampled tokens per sample")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward")
    p.add_argument("--chunk", type=int, default=1024, help="scored tokens per lm-head chunk")
    p.add_argument("--repeats", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def random_model_dir() -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(tempfile.mkdtemp(prefix="bench_llama_"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def naive_logprobs(model, input_ids_BT, attention_mask_BT, temperature_B, score_mask_BT,
                   chunk_tokens=0):
    import torch

    from flywheel.trainer.logprobs import TokenLogprobs, naive_token_logprobs

    logprobs_BT = naive_token_logprobs(model, input_ids_BT, attention_mask_BT, temperature_B)
    masked_BT = torch.where(score_mask_BT, logprobs_BT, 0.0)
    return TokenLogprobs(masked_BT, torch.zeros_like(masked_BT))


def build_groups(args, vocab: int):
    import torch

    from flywheel.core.codec import new_sample

    gen = torch.Generator().manual_seed(0)
    n = args.prompt + args.completion
    mask = [0] * args.prompt + [1] * args.completion
    samples = [
        new_sample(
            token_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(), loss_mask=mask,
            rollout_logprobs=[-2.0 * m for m in mask], weight_versions=[m - 1 for m in mask],
            group_id=f"g{i // 8}", reward=float(i % 2), has_reward=True,
        )
        for i in range(args.samples)
    ]
    return [samples[i:i + 8] for i in range(0, len(samples), 8)]


def logprob_pass(model, batch, cfg, logprob_fn) -> float:
    """Forward + backward of the summed logprobs over all micro-batches; returns seconds."""
    from flywheel.trainer.batch import micro_batches

    t0 = time.perf_counter()
    for mb in micro_batches(batch, cfg.micro_batch_size):
        out = logprob_fn(model, mb.input_ids_BT, mb.attention_mask_BT, mb.temperature_B,
                         mb.loss_mask_BT, chunk_tokens=cfg.logprob_chunk_tokens)
        out.logprobs_BT.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def run_variant(args) -> dict:
    """One variant in this process: logprob pass peak memory, then timed optimizer steps."""
    import torch

    from flywheel.trainer import step as step_module
    from flywheel.trainer.weights import load_model

    model = load_model(Path(args.model))
    cfg = step_module.StepConfig(micro_batch_size=args.micro_batch, logprob_chunk_tokens=args.chunk)
    batch, _ = step_module.prepare_batch(build_groups(args, model.config.vocab_size), cfg)
    if args.variant == "naive":
        step_module.selected_token_logprobs = naive_logprobs
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logprob_s = logprob_pass(model, batch, cfg, step_module.selected_token_logprobs)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    step_module.train_step(model, optimizer, batch, cfg)  # warm-up; allocates AdamW state
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step_module.train_step(model, optimizer, batch, cfg)
        times.append(time.perf_counter() - t0)
    return {
        "variant": args.variant,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_s": min(times),
        "logprob_s": logprob_s,
        "logprob_peak_mib": (peak_kib - base_kib) / 1024,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    args = parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    model = args.model or str(random_model_dir())
    rows = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant, "--model", model] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("variant", "model")
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    naive, chunked = rows["naive"], rows["chunked"]
    print(f"model {args.model or 'random Llama 4x256, vocab 49152'} ({naive['params_m']:.1f}M "
          f"params), {args.samples} samples x {args.prompt + args.completion} tokens "
          f"({args.completion} sampled), micro-batch {args.micro_batch}, "
          f"{naive['threads']} threads, fp32, AdamW")
    print(f"{'':14}{'step s':>8}{'logprob fwd+bwd s':>20}{'its peak extra MiB':>20}")
    for name, row in rows.items():
        print(f"{name:14}{row['step_s']:>8.2f}{row['logprob_s']:>20.2f}"
              f"{row['logprob_peak_mib']:>20.0f}")
    keys = ("step_s", "logprob_s", "logprob_peak_mib")
    ratio = {k: chunked[k] / max(naive[k], 1e-9) for k in keys}
    print(f"{'chunked/naive':14}{ratio['step_s']:>7.2f}x{ratio['logprob_s']:>19.2f}x"
          f"{ratio['logprob_peak_mib']:>19.2f}x")


if __name__ == "__main__":
    main()
