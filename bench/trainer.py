"""Trainer benchmarks, side by side in one run (ratios; times vary with other load).

1. Selected-token logprobs at vocab 49152 (SmolLM2's lm head, hidden 576): peak memory and
   seconds of forward + backward of `sum_t logprob_t` over T positions, the fused chunked head
   (`TemperedHeadLogprob`, `--chunk` positions at a time) against the naive full float32
   `log_softmax(h W^T / temperature)` + gather. Each (variant, T) runs in a fresh subprocess;
   its peak is the growth of max RSS over the inputs already allocated.
2. Trainer tokens/s for SmolLM2-135M-Instruct on this CPU: `train_step` (AdamW, fp32 master
   weights) on fake GRPO groups, fp32 and with bf16 autocast, one warm-up step then timed steps.
3. Micro-batch layouts on samples of very different lengths (`--spread`: completions from
   `--completion / spread` to `--completion` tokens): padded in arrival order, padded
   length-sorted under a token budget (`micro_batch_tokens`), and packed (`batch_layout =
   "packed"`); padding share of the decoder positions and forward + backward seconds of the
   micro-batches (the AdamW step is the same for all three), ratios to padded.
4. Shared prompts (a GRPO step: `--groups` x `--group-size` samples, one prompt per group):
   forward + backward seconds of the micro-batches, padded against `layout =
   "shared_prefix"` (each group's prompt run once: one packed pass per micro-batch) and its
   key/value-cache path (`shared_prefix_cache`, what micro-batches over 1024 positions use),
   and the peak RSS of each; `--compare-rev REV` adds REV's padded and shared_prefix.

    .venv/bin/python bench/trainer.py                     # both parts, T = 512 2048 8192
    .venv/bin/python bench/trainer.py --part logprobs --lengths 512 2048
    .venv/bin/python bench/trainer.py --part step --samples 8 --prompt 64 --completion 64
    .venv/bin/python bench/trainer.py --part layout --samples 8 --prompt 16 --completion 256
    .venv/bin/python bench/trainer.py --part prefix --prompt 44 --completion 32 --spread 8
    .venv/bin/python bench/trainer.py --part prefix --prompt 44 --replies 2,2,3,3,4,6,12,32 \
        --repeats 3 --rounds 2 --compare-rev REV      # the demo's shapes, against REV's code
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB, HIDDEN = 49152, 576


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=["all", "logprobs", "step", "layout", "prefix"], default="all")
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[512, 2048, 8192],
        help="scored positions T for part 1",
    )
    p.add_argument("--chunk", type=int, default=1024, help="positions per head chunk")
    p.add_argument("--model", default="", help="model folder for part 2 (default: SmolLM2)")
    p.add_argument("--samples", type=int, default=8, help="samples per step (groups of 4)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    p.add_argument("--completion", type=int, default=64, help="sampled tokens per sample")
    p.add_argument("--repeats", type=int, default=1, help="timed steps after the warm-up")
    p.add_argument("--spread", type=int, default=16, help="part 3: longest / shortest completion")
    p.add_argument(
        "--replies",
        default="",
        help="part 4: completion lengths, comma-separated, used in turn (e.g. the demo's mix "
        "2,2,3,3,4,6,12,32); default: --completion / --spread .. --completion",
    )
    p.add_argument("--rounds", type=int, default=1, help="part 4: interleaved rounds (median)")
    p.add_argument("--compare-rev", default="", help="part 4: also run git revision REV's code")
    p.add_argument("--groups", type=int, default=4, help="part 4: groups sharing a prompt")
    p.add_argument("--group-size", type=int, default=8, help="part 4: samples per group")
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "bf16_autocast"],
        choices=["fp32", "bf16_autocast"],
        help="part 2: precisions to time",
    )
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def logprob_child(variant: str, length: int, chunk: int) -> dict:
    """One variant at one T in this process: seconds and peak MiB of forward + backward."""
    import torch

    from flywheel.trainer.logprobs import TemperedHeadLogprob

    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(length, HIDDEN, generator=gen) * 0.5).requires_grad_(True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (length,), generator=gen)
    temperature = torch.full((length,), 0.7)
    base = max_rss_mib()
    t0 = time.perf_counter()
    if variant == "naive":
        logp = torch.log_softmax((hidden @ weight.T) / temperature[:, None], dim=-1)
        total = logp.gather(1, targets[:, None]).sum()
    else:
        parts = [
            TemperedHeadLogprob.apply(
                hidden[s : s + chunk], weight, targets[s : s + chunk], temperature[s : s + chunk]
            )[0]
            for s in range(0, length, chunk)
        ]
        total = torch.cat(parts).sum()
    total.backward()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_mib": max_rss_mib() - base, "value": float(total)}


def run_child(args: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_logprobs(args: argparse.Namespace) -> None:
    print(
        f"selected-token logprobs, vocab {VOCAB}, hidden {HIDDEN}, chunk {args.chunk}, "
        "forward + backward, fp32"
    )
    print(
        f"{'T':>6}{'naive s':>9}{'chunked s':>11}{'time ratio':>12}"
        f"{'naive MiB':>11}{'chunked MiB':>13}{'memory ratio':>14}"
    )
    for length in args.lengths:
        rows = {
            v: run_child(["--child", f"{v}:{length}:{args.chunk}"]) for v in ("naive", "chunked")
        }
        n, c = rows["naive"], rows["chunked"]
        assert abs(n["value"] - c["value"]) <= 1e-3 * abs(n["value"]), (n, c)
        print(
            f"{length:>6}{n['seconds']:>9.2f}{c['seconds']:>11.2f}"
            f"{c['seconds'] / n['seconds']:>11.2f}x{n['peak_mib']:>11.0f}"
            f"{c['peak_mib']:>13.0f}{c['peak_mib'] / max(n['peak_mib'], 1e-9):>13.3f}x"
        )


def step_child(args: argparse.Namespace, precision: str) -> dict:
    import torch

    from flywheel.core.paths import resolve_model_path
    from flywheel.core.trainer_settings import BatchSettings
    from flywheel.trainer.sources import FakeSource
    from flywheel.trainer.step import StepConfig, prepare_batch, train_step
    from flywheel.trainer.weights import load_model

    model = load_model(resolve_model_path(args.model))
    source = FakeSource(model.config.vocab_size, 4, args.prompt, args.completion)
    samples = [e.sample for e in source.read(args.samples, 0)]
    groups = [samples[i : i + 4] for i in range(0, len(samples), 4)]
    cfg = StepConfig(
        batch=BatchSettings(micro_batch_size=4), bf16_autocast=precision == "bf16_autocast"
    )
    batch, _ = prepare_batch(groups, cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    train_step(model, optimizer, batch, cfg)  # warm-up, allocates AdamW state
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        result = train_step(model, optimizer, batch, cfg)
        times.append(time.perf_counter() - t0)
    tokens = float(batch.attention_mask_BT.sum())
    return {
        "step_s": min(times),
        "tokens": tokens,
        "tokens_per_s": tokens / min(times),
        "peak_mib": max_rss_mib(),
        "skipped": result.skipped,
        "threads": torch.get_num_threads(),
    }


def timed_accumulate(model, batch, cfg, repeats: int):  # noqa: ANN001, ANN201
    """(fastest of `repeats` timed seconds, its `Accumulated`) of forward + backward of every
    micro-batch of `batch` (`accumulate`), after a one-sample warm-up."""
    from flywheel.trainer.algorithms.losses import normalizer_for
    from flywheel.trainer.step import accumulate

    norm = normalizer_for(batch.loss_mask_BT)
    accumulate(model, batch.rows(0, 1), cfg, norm)  # warm-up: one sample
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        acc = accumulate(model, batch, cfg, norm)
        times.append(time.perf_counter() - t0)
    return min(times), acc


def layout_child(args: argparse.Namespace, layout: str) -> dict:
    """Forward + backward seconds of all micro-batches (`accumulate`; the AdamW step does not
    depend on the layout) and the decoder padding share of one layout on spread lengths."""
    import torch

    from flywheel.core.paths import resolve_model_path
    from flywheel.core.trainer_settings import BatchSettings
    from flywheel.trainer.sources import FakeSource
    from flywheel.trainer.step import StepConfig, prepare_batch, split_micro_batches
    from flywheel.trainer.weights import load_model

    model = load_model(resolve_model_path(args.model))
    samples = []
    for i in range(args.samples):  # completions spread evenly from longest / spread to longest
        shortest = max(args.completion // args.spread, 1)
        completion = shortest + (args.completion - shortest) * i // max(args.samples - 1, 1)
        source = FakeSource(model.config.vocab_size, 1, args.prompt, completion, seed=i)
        samples.append(source.read(1, 0)[0].sample)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    samples = [samples[i] for i in order]  # arrival order, not sorted
    groups = [samples[i : i + 4] for i in range(0, len(samples), 4)]
    longest = args.prompt + args.completion
    cfg = StepConfig(
        batch=BatchSettings(
            micro_batch_size=4,
            micro_batch_tokens={"padded": 0, "sorted": 4 * longest // 2, "packed": 4 * longest}[
                layout
            ],
            layout="packed" if layout == "packed" else "padded",
        )
    )
    batch, _ = prepare_batch(groups, cfg)
    parts = split_micro_batches(batch, cfg)
    real = float(batch.attention_mask_BT.sum())
    positions = (
        real if cfg.packed else float(sum(mb.size * mb.input_ids_BT.shape[1] for mb in parts))
    )
    seconds, acc = timed_accumulate(model, batch, cfg, args.repeats)
    return {
        "step_s": seconds,
        "tokens": real,
        "positions": positions,
        "micro_batches": len(parts),
        "loss": acc.loss,
        "skipped": "",
    }


def prefix_child(args: argparse.Namespace, layout: str) -> dict:
    """Forward + backward seconds of a GRPO step's micro-batches (`accumulate`) under `layout`:
    `--groups` groups of `--group-size` samples, each group's samples sharing one `--prompt`
    token prompt, completions spread from `--completion / --spread` to `--completion`."""
    import torch

    from flywheel.core.paths import resolve_model_path
    from flywheel.core.trainer_settings import BatchSettings
    from flywheel.trainer.sources import FakeSource
    from flywheel.trainer.step import StepConfig, prepare_batch
    from flywheel.trainer.weights import load_model

    if layout == "shared_prefix_cache":  # the prompt's key/value cache path at every size
        import flywheel.trainer.shared_prefix_packed as one_pass

        one_pass.PACKED_MAX_TOKENS = 0
        layout = "shared_prefix"
    torch.manual_seed(0)
    model = load_model(resolve_model_path(args.model))
    vocab = model.config.vocab_size
    shortest = max(args.completion // args.spread, 1)
    replies = [int(x) for x in args.replies.split(",")] if args.replies else []
    groups = []
    for g in range(args.groups):
        prompt = torch.randint(1, vocab, (args.prompt,)).tolist()
        members = []
        for i in range(args.group_size):
            completion = shortest + (args.completion - shortest) * i // max(args.group_size - 1, 1)
            if replies:  # the mix, rotated per group so groups differ
                completion = replies[(i + 3 * g) % len(replies)]
            source = FakeSource(vocab, 1, args.prompt, completion, seed=100 * g + i)
            sample = source.read(1, 0)[0].sample
            sample.token_ids[: args.prompt] = prompt
            members.append(sample)
        groups.append(members)
    cfg = StepConfig(batch=BatchSettings(micro_batch_size=args.group_size, layout=layout))
    batch, _ = prepare_batch(groups, cfg)
    seconds, acc = timed_accumulate(model, batch, cfg, args.repeats)
    return {
        "step_s": seconds,
        "tokens": float(batch.attention_mask_BT.sum()),
        "loss": acc.loss,
        "peak_mib": max_rss_mib(),
        "threads": torch.get_num_threads(),
    }


def child_args(args: argparse.Namespace, *names: str) -> list[str]:
    """`--name=value` of each of `names` (attribute names of `args`), plus `--model` if set."""
    out = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]
    return out + ([f"--model={args.model}"] if args.model else [])


def exported_services(rev: str) -> str:
    """`services/` of git revision `rev`, exported to a temporary folder (its path)."""
    folder = tempfile.mkdtemp(prefix="flywheel-rev-")
    archive = subprocess.run(["git", "archive", rev, "services"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return str(Path(folder) / "services")


def bench_prefix(args: argparse.Namespace) -> None:
    common = child_args(
        args, "groups", "group_size", "prompt", "completion", "repeats", "spread", "replies"
    )
    variants = [("padded", None), ("shared_prefix", None), ("shared_prefix_cache", None)]
    if args.compare_rev:  # interleaved with this tree's, same shapes
        old = exported_services(args.compare_rev)
        variants = [
            ("padded", None),
            ("padded", old),
            ("shared_prefix", None),
            ("shared_prefix", old),
            ("shared_prefix_cache", None),
        ]
    rows: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for layout, services in variants:
            name = layout + (f" @{args.compare_rev}" if services else "")
            env = os.environ | ({"PYTHONPATH": services} if services else {})
            row = run_child(["--child", f"prefix:{layout}", *common], env)
            rows.setdefault(name, []).append(row)
    base = statistics.median(r["step_s"] for r in rows["padded"])
    mix = args.replies or f"{max(args.completion // args.spread, 1)}..{args.completion}"
    print(
        f"\nshared prompts, {args.model or 'SmolLM2-135M-Instruct'}: {args.groups} groups x "
        f"{args.group_size} samples, prompt {args.prompt} tokens shared in a group, completions "
        f"{mix} tokens, micro-batch = group, fp32, {rows['padded'][0]['threads']} threads; "
        f"median of {args.rounds} interleaved rounds (each the fastest of {args.repeats} steps)"
    )
    print(f"{'layout':>28}{'fwd+bwd s':>11}{'x padded':>10}{'peak RSS MiB':>14}{'loss':>12}")
    for name, runs in rows.items():
        seconds = statistics.median(r["step_s"] for r in runs)
        print(
            f"{name:>28}{seconds:>11.2f}{seconds / base:>9.2f}x"
            f"{max(r['peak_mib'] for r in runs):>14.0f}{runs[0]['loss']:>12.6f}"
        )


def bench_layout(args: argparse.Namespace) -> None:
    common = child_args(args, "samples", "prompt", "completion", "repeats", "spread")
    rows = {
        v: run_child(["--child", f"layout:{v}", *common]) for v in ("padded", "sorted", "packed")
    }
    base = rows["padded"]
    print(
        f"\nmicro-batch layouts, {args.model or 'SmolLM2-135M-Instruct'}: {args.samples} "
        f"samples, prompt {args.prompt}, completions {max(args.completion // args.spread, 1)}"
        f"..{args.completion} tokens ({base['tokens']:.0f} real), micro-batch 4, fp32"
    )
    print(
        f"{'layout':>8}{'micro-batches':>15}{'positions':>11}{'padding':>9}{'fwd+bwd s':>11}"
        f"{'time ratio':>12}{'loss':>12}"
    )
    for name, row in rows.items():
        assert not row["skipped"], row
        padding = 1.0 - row["tokens"] / row["positions"]
        print(
            f"{name:>8}{row['micro_batches']:>15}{row['positions']:>11.0f}{padding:>9.1%}"
            f"{row['step_s']:>11.2f}{row['step_s'] / base['step_s']:>11.2f}x"
            f"{row['loss']:>12.6f}"
        )


def bench_step(args: argparse.Namespace) -> None:
    common = child_args(args, "samples", "prompt", "completion", "repeats")
    rows = {p: run_child(["--child", f"step:{p}", *common]) for p in args.precisions}
    fp32 = rows["fp32"]
    print(
        f"\ntrainer step, {args.model or 'SmolLM2-135M-Instruct'}: {args.samples} samples x "
        f"{args.prompt + args.completion} tokens ({args.completion} sampled), micro-batch 4, "
        f"AdamW, {fp32['threads']} threads"
    )
    print(f"{'precision':>14}{'step s':>9}{'tokens/s':>10}{'peak RSS MiB':>14}")
    for name, row in rows.items():
        assert not row["skipped"], row
        print(
            f"{name:>14}{row['step_s']:>9.2f}{row['tokens_per_s']:>10.1f}{row['peak_mib']:>14.0f}"
        )
    if "bf16_autocast" not in rows or "fp32" not in rows:
        return
    bf16 = rows["bf16_autocast"]
    print(
        f"{'bf16/fp32':>14}{bf16['step_s'] / fp32['step_s']:>8.2f}x"
        f"{bf16['tokens_per_s'] / fp32['tokens_per_s']:>9.2f}x"
        f"{bf16['peak_mib'] / fp32['peak_mib']:>13.2f}x"
    )


def main() -> None:
    args = parse_args()
    if args.child:
        kind, _, rest = args.child.partition(":")
        if kind == "step":
            print(json.dumps(step_child(args, rest)))
        elif kind == "layout":
            print(json.dumps(layout_child(args, rest)))
        elif kind == "prefix":
            print(json.dumps(prefix_child(args, rest)))
        else:
            length, chunk = (int(x) for x in rest.split(":"))
            print(json.dumps(logprob_child(kind, length, chunk)))
        return
    if args.part in ("all", "logprobs"):
        bench_logprobs(args)
    if args.part in ("all", "step"):
        bench_step(args)
    if args.part in ("all", "layout"):
        bench_layout(args)
    if args.part in ("all", "prefix"):
        bench_prefix(args)


if __name__ == "__main__":
    main()
