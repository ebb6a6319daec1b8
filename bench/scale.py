"""Per-step trainer I/O at model sizes: commit, checkpoint, full and delta push; a projection.

Random-weight Llama models of the SmolLM2 family's shapes (no downloads; `LlamaConfig`):
135m (hidden 576, 30 layers), 360m (960, 32) and 1.7b (2048, 24), each in its own subprocess
(peak RSS per size). Per size and step, with the project's own code:

* commit: `CommitLog.append` of a step of `--groups` x `--group` samples with its RNG state (the
  record fsynced before a step counts as committed);
* checkpoint: `CheckpointStore.save` of the fp32 weights plus AdamW state (exp_avg and
  exp_avg_sq, fp32, the size a real optimizer holds) and the tokenizer files, divided by
  `--checkpoint-every` (the trainer's `checkpoint.every`); skipped at sizes above
  `--checkpoint-max` (1.7b needs 27 GB for weights + AdamW), projected like 8B/70B instead;
* push, bf16 (the dtype deltas are for): full = `WeightsStore.write` of `model.safetensors` +
  the engine's read (`load_file`); delta = `DeltaWeightsStore.write` (bitwise compare against
  the last version, xxh3-128 of every tensor, `delta.safetensors`) + the engine's checks
  (`build_result` + `check_digests`). Between steps a share `--changed` of each tensor's
  elements moves by one bf16 step (a stand-in for the optimizer: the share is what
  bench/delta_push.py measures on the demo's training, ~2% at lr 5e-6).

Then 8B and 70B (Llama-3 parameter counts) are projected from the largest measured size's
bytes per second (push, checkpoint) and elements per second (delta compare + digests) and
printed as a table. Other people's load on a shared machine changes the seconds; the ratios
(delta/full, per-size growth) are the result.

    .venv/bin/python bench/scale.py                            # 135m 360m 1.7b, 3 steps
    .venv/bin/python bench/scale.py --sizes 135m 360m --steps 2
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # hidden, layers, intermediate, heads, kv heads (SmolLM2 shapes, vocab 49152, tied)
    "135m": (576, 30, 1536, 9, 3),
    "360m": (960, 32, 2560, 15, 5),
    "1.7b": (2048, 24, 8192, 32, 32),
}
PROJECTED = {"8B": 8.03e9, "70B": 70.6e9}
"""Parameter counts of Llama-3-8B and Llama-3-70B."""
ADAM_BYTES_PER_PARAM = 12
"""fp32 weights (4) + AdamW exp_avg (4) + exp_avg_sq (4) in a checkpoint."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--steps", type=int, default=3, help="pushes per size (the first is full)")
    p.add_argument("--changed", type=float, default=0.02, help="share of elements changed/step")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--checkpoint-max", default="360m", help="largest size checkpointed")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_model(size: str):  # noqa: ANN201
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, inter, heads, kv = SIZES[size]
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return model


def nudge(state, share: float, seed: int):  # noqa: ANN001, ANN201
    """A copy of `state` with about a `share` of each tensor's elements (drawn with
    replacement) one bf16 step up."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        new = t.clone()
        flat = new.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * share)),), generator=g)
        flat[idx] = torch.nextafter(flat[idx], torch.full_like(flat[idx], float("inf")))
        out[name] = new
    return out


def child(args: argparse.Namespace) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from flywheel.engine.deltas import build_result, check_digests
    from flywheel.trainer.commits import CommitLog, CommitRecord, GroupRecord, capture_rng
    from flywheel.trainer.deltas import DeltaWeightsStore, checksums_of
    from flywheel.trainer.weights import CheckpointStore, WeightsStore, unique_storage

    size = args.child
    root = Path(tempfile.mkdtemp(prefix=f"scale_{size}_"))
    source = root / "source"
    source.mkdir()
    (source / "tokenizer_config.json").write_text("{}")
    model = build_model(size)
    params = sum(p.numel() for p in model.parameters())
    out: dict = {"size": size, "params": params}
    try:
        # commit
        log = CommitLog(root)
        times = []
        for step in range(1, 6):
            n = args.groups * args.group
            groups = [
                GroupRecord(f"g{step}-{i}", [f"{step}-{i}-{j}" for j in range(args.group)])
                for i in range(args.groups)
            ]
            record = CommitRecord(step, groups, [f"s{step}-{k}" for k in range(n)], capture_rng())
            t0 = time.perf_counter()
            log.append(record)
            times.append(time.perf_counter() - t0)
        out["commit_s"] = statistics.median(times)
        out["commit_bytes"] = log.path.stat().st_size / 5

        # checkpoint (fp32 weights + AdamW state)
        order = list(SIZES)
        if order.index(size) <= order.index(args.checkpoint_max):
            fp32 = {k: v.float() for k, v in unique_storage(model.state_dict()).items()}
            adam = {
                "state": {
                    i: {
                        "step": torch.tensor(1.0),
                        "exp_avg": torch.zeros_like(v),
                        "exp_avg_sq": torch.zeros_like(v),
                    }
                    for i, v in enumerate(unique_storage(fp32).values())
                },
                "param_groups": [{"lr": 5e-6, "params": list(range(len(fp32)))}],
            }
            store = CheckpointStore(root / "ckpt", keep=1, source_dir=source)
            t0 = time.perf_counter()
            path = store.save(model, 1, {}, {"optimizer": adam}, state_dict=fp32)
            out["checkpoint_s"] = time.perf_counter() - t0
            out["checkpoint_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            del fp32, adam
            shutil.rmtree(root / "ckpt")

        # pushes in bf16: step 1 full (no base), then deltas
        state = {k: v.detach().clone() for k, v in unique_storage(model.state_dict()).items()}
        del model
        deltas = DeltaWeightsStore(WeightsStore(root, source, keep=1))
        t0 = time.perf_counter()
        folder = deltas.write(1, state)
        out["full_write_s"] = time.perf_counter() - t0
        full = folder / "model.safetensors"
        out["full_bytes"] = full.stat().st_size
        t0 = time.perf_counter()
        loaded = load_file(full)
        out["full_read_s"] = time.perf_counter() - t0
        del loaded
        served = state
        rows = []
        for step in range(2, args.steps + 1):
            new = nudge(served, args.changed, step)
            t0 = time.perf_counter()
            folder = deltas.write(step, new)
            write_s = time.perf_counter() - t0
            delta = folder / "delta.safetensors"
            t0 = time.perf_counter()
            with safe_open(str(delta), framework="pt") as f:
                entries = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            result, _ = build_result(served, entries)
            check_digests(served, result, checksums_of(delta))
            engine_s = time.perf_counter() - t0
            rows.append((write_s, engine_s, delta.stat().st_size))
            del result, entries
            served = new
        out["delta_write_s"] = statistics.median(r[0] for r in rows)
        out["delta_apply_s"] = statistics.median(r[1] for r in rows)
        out["delta_bytes"] = statistics.median(r[2] for r in rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    import torch

    print(f"torch threads {torch.get_num_threads()}, changed share {args.changed:.1%}/step")
    results = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--child", size, *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{size}: failed\n{done.stderr[-2000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    every = args.checkpoint_every
    print(
        f"\n{'size':>6} {'params':>8} {'commit ms':>10} {'ckpt s/step':>12} {'ckpt B/step':>12} "
        f"{'full s':>8} {'full B':>10} {'delta s':>8} {'delta B':>10} {'delta/full':>10} "
        f"{'peak MiB':>9}"
    )
    for r in results:
        full_s = r["full_write_s"] + r["full_read_s"]
        delta_s = r["delta_write_s"] + r["delta_apply_s"]
        ck_s = f"{r['checkpoint_s'] / every:.2f}" if "checkpoint_s" in r else "-"
        ck_b = fmt_bytes(r["checkpoint_bytes"] / every) if "checkpoint_bytes" in r else "-"
        print(
            f"{r['size']:>6} {r['params'] / 1e6:>7.0f}M {r['commit_s'] * 1e3:>10.2f} "
            f"{ck_s:>12} {ck_b:>12} {full_s:>8.2f} {fmt_bytes(r['full_bytes']):>10} "
            f"{delta_s:>8.2f} {fmt_bytes(r['delta_bytes']):>10} "
            f"{r['delta_bytes'] / r['full_bytes']:>10.3f} {r['peak_mib']:>9.0f}"
        )
    if not results:
        return
    big = results[-1]
    full_bps = big["full_bytes"] / (big["full_write_s"] + big["full_read_s"])
    delta_eps = big["params"] / (big["delta_write_s"] + big["delta_apply_s"])
    ratio = big["delta_bytes"] / big["full_bytes"]
    ck = [r for r in results if "checkpoint_s" in r]
    ck_bps = ck[-1]["checkpoint_bytes"] / ck[-1]["checkpoint_s"] if ck else 0.0
    commit = max(r["commit_s"] for r in results)
    print(
        f"\nprojection from {big['size']} (push: {full_bps / 1e6:.0f} MB/s full, "
        f"{delta_eps / 1e6:.0f} M elements/s delta, delta/full {ratio:.3f}; checkpoint "
        f"{ck_bps / 1e6:.0f} MB/s from {ck[-1]['size'] if ck else '-'}), one trainer, one engine"
    )
    print(
        f"{'model':>6} {'commit ms':>10} {'ckpt s/step':>12} {'ckpt B/step':>12} {'full s':>8} "
        f"{'full B':>10} {'delta s':>8} {'delta B':>10}"
    )
    for name, n in PROJECTED.items():
        ck_bytes = n * ADAM_BYTES_PER_PARAM
        ck_s = f"{ck_bytes / ck_bps / every:.1f}" if ck_bps else "-"
        print(
            f"{name:>6} {commit * 1e3:>10.2f} {ck_s:>12} {fmt_bytes(ck_bytes / every):>12} "
            f"{2 * n / full_bps:>8.1f} {fmt_bytes(2 * n):>10} {n / delta_eps:>8.1f} "
            f"{fmt_bytes(2 * n * ratio):>10}"
        )


if __name__ == "__main__":
    main()
