"""Bytes per weight push on the demo's training: full weights against deltas, fp32 and bf16.

SmolLM2-135M-Instruct (the demo's model) trained with the demo's trainer settings (defaults of
`[trainer.optim]`: AdamW lr 5e-6, betas (0.9, 0.999), grad clip 1.0; fp32 master weights) by
the real `train_step` on fake GRPO groups of the demo's shape (`--groups` groups of `--group`
samples, `--prompt` + `--completion` tokens; Adam's per-element step is about lr whatever the
data, so the changed share depends on lr and the weights, not on the task). After each step the
weights are snapshot in each push dtype exactly as the trainer does (`cpu_snapshot`) and written
by the trainer's `DeltaWeightsStore` (step 1 is full: no base); per step and dtype it prints the
share of elements that changed, the delta file's bytes against the full `model.safetensors`,
how many changed tensors went whole (`:full`) and zlib-compressed (`:zsparse`; the rest are
`:gap` + `:val`), and the seconds of the write (compare + compression + digests + file) and of
the engine's checks (`build_result` + `check_digests`, no HTTP).

    .venv/bin/python bench/delta_push.py                       # 5 steps, fp32 and bf16
    .venv/bin/python bench/delta_push.py --steps 3 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (the first push is full)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--groups", type=int, default=4, help="groups per step (demo: 4)")
    p.add_argument("--group", type=int, default=8, help="samples per group (demo: 8)")
    p.add_argument("--prompt", type=int, default=48, help="prompt tokens per sample")
    p.add_argument("--completion", type=int, default=32, help="sampled tokens per sample")
    p.add_argument("--lr", type=float, default=0.0, help="0 = the settings' default")
    p.add_argument("--model", default="", help="model folder (default: the demo's SmolLM2)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    import torch
    from safetensors import safe_open

    from flywheel.core.paths import resolve_model_path
    from flywheel.core.settings import load_settings
    from flywheel.engine.deltas import build_result, check_digests
    from flywheel.trainer.deltas import DeltaWeightsStore, checksums_of
    from flywheel.trainer.snapshots import cpu_snapshot
    from flywheel.trainer.sources import FakeSource
    from flywheel.trainer.step import StepConfig, build_optimizer, prepare_batch, train_step
    from flywheel.trainer.weights import WeightsStore, load_model

    optim = {"lr": args.lr} if args.lr else {}
    settings = load_settings(trainer={"optim": optim, "precision": "fp32"})
    s = settings.trainer
    source_dir = resolve_model_path(args.model or settings.engine.model_path)
    model = load_model(source_dir)
    optimizer = build_optimizer(model, s.optim)
    cfg = StepConfig.from_settings(s)
    source = FakeSource(model.config.vocab_size, args.group, args.prompt, args.completion)
    tmp = Path(tempfile.mkdtemp(prefix="delta_push_"))
    stores = {d: DeltaWeightsStore(WeightsStore(tmp / d, source_dir, keep=2)) for d in args.dtypes}
    served: dict[str, dict[str, torch.Tensor]] = {}
    print(
        f"model {source_dir.name}, lr {s.optim.lr:g}, {args.groups}x{args.group} samples of "
        f"{args.prompt}+{args.completion} tokens, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'step':>4} {'dtype':>9} {'changed %':>10} {'full MB':>9} {'push MB':>9} "
        f"{'push/full':>9} {'whole':>7} {'zlib':>7} {'write s':>8} {'engine s':>9}"
    )
    for step in range(1, args.steps + 1):
        samples = [e.sample for e in source.read(args.groups * args.group, 0)]
        groups = [samples[i : i + args.group] for i in range(0, len(samples), args.group)]
        batch, _ = prepare_batch(groups, cfg)
        result = train_step(model, optimizer, batch, cfg)
        assert not result.skipped, result
        for dtype, store in stores.items():
            snapshot = cpu_snapshot(model.state_dict(), getattr(torch, dtype))
            t0 = time.perf_counter()
            folder = store.write(step, snapshot)
            write_s = time.perf_counter() - t0
            state = store._held.state if store._held else {}
            full_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
            delta = folder / "delta.safetensors"
            engine_s, changed, whole, packed = 0.0, 100.0, "-", "-"
            if delta.is_file():
                t0 = time.perf_counter()
                with safe_open(str(delta), framework="pt") as f:
                    entries = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                new, _ = build_result(served[dtype], entries)
                check_digests(served[dtype], new, checksums_of(delta))
                engine_s = time.perf_counter() - t0
                st = store.last_stats
                assert st is not None
                changed = 100 * st.changed_elements / st.elements
                whole = f"{st.full_tensors}/{st.tensors}"
                packed = f"{st.compressed_tensors}/{st.tensors}"
                push_mb = delta.stat().st_size / 1e6
            else:
                push_mb = (folder / "model.safetensors").stat().st_size / 1e6
            served[dtype] = dict(state)  # the engine now serves this version
            print(
                f"{step:>4} {dtype:>9} {changed:>10.2f} {full_mb:>9.1f} {push_mb:>9.1f} "
                f"{push_mb / full_mb:>9.3f} {whole:>7} {packed:>7} {write_s:>8.2f} "
                f"{engine_s:>9.2f}",
                flush=True,
            )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB; files under {tmp}")


if __name__ == "__main__":
    main()
