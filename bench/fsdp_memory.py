"""Peak memory per rank of loading the policy and its KL reference under FSDP2, the old way
against the new way, side by side in one run (CPU, gloo, `--ranks` processes per way).

- old: every rank loads the whole fp32 model (`from_pretrained`), then `fully_shard`s it; the KL
  reference is loaded whole on every rank and stays so.
- new (`flywheel.trainer.fsdp_load`): the model is built on the meta device and sharded; each
  rank reads only its shards' rows from the safetensors; the reference is sharded the same way.

The model is a random-weight Llama of the SmolLM2 shapes (`--size 135m`: hidden 576, 30 layers;
`360m`: hidden 960, 32 layers; vocab 49152, tied embeddings), written once as fp32 safetensors
to a temporary folder (no download). Each way runs in fresh processes; every rank reports its
resident memory after start-up (torch imported, process group up: the baseline), then over
it: the peak while loading, what stays resident after loading, and the peak through one
KL-regularized training step (`--samples` random samples, AdamW), sampled every 2 ms from
/proc/self/status, private memory (RssAnon) apart from mapped file pages (RssFile: the
safetensors that `from_pretrained` and the shard reader map; page cache the ranks of a machine
share, which on a GPU would be copied to each rank's device). Printed per rank, then old / new
ratios.

    .venv/bin/python bench/fsdp_memory.py                  # 135m, 2 ranks, both ways
    .venv/bin/python bench/fsdp_memory.py --size 360m
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

SIZES = {
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
             "num_attention_heads": 9, "num_key_value_heads": 3},
    "360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
             "num_attention_heads": 15, "num_key_value_heads": 5},
}  # fmt: skip
"""SmolLM2-135M and -360M shapes (their config.json), vocab 49152, tied embeddings."""
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="135m")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ways", nargs="+", choices=["old", "new"], default=["old", "new"])
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(DTYPES),
        default=["bf16", "fp32"],
        help="dtype of the safetensors file (the trainer loads fp32 either way)",
    )
    p.add_argument("--samples", type=int, default=4, help="samples in the training step (0: none)")
    p.add_argument("--tokens", type=int, default=64, help="prompt and completion tokens each")
    return p.parse_args(argv)


def status_mib() -> dict[str, float]:
    """This process' resident memory now, MiB: `anon` (private: heap, tensors' storage),
    `file` (pages of mapped files, e.g. safetensors read through mmap: page cache that the
    ranks of a machine share) and `rss` (both)."""
    kib = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
            kib[key] = int(value.split()[0])
    return {
        "anon": kib["RssAnon"] / 1024,
        "file": (kib["RssFile"] + kib["RssShmem"]) / 1024,
        "rss": kib["VmRSS"] / 1024,
    }


class PeakSampler:
    """Peaks of `status_mib` sampled every `interval_s` in a thread (a peak shorter than the
    interval can be missed; allocations of hundreds of MiB last longer than 2 ms)."""

    def __init__(self, interval_s: float = 0.002):
        import threading

        self.interval_s = interval_s
        self.peak = status_mib()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            now = status_mib()
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
            self.stop.wait(self.interval_s)

    def reset(self) -> None:
        self.peak = status_mib()

    def read(self) -> dict[str, float]:
        now = status_mib()
        return {k: max(v, now[k]) for k, v in self.peak.items()}


def write_models(root: Path, size: str, dtypes: list[str]) -> int:
    """A random-weight Llama of `size` saved as safetensors in each of `dtypes` (folders
    `root/<dtype>`); returns its parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **SIZES[size])
    model = LlamaForCausalLM(config)
    for dtype in dtypes:
        model.to(getattr(torch, DTYPES[dtype])).save_pretrained(root / dtype)
    return sum(p.numel() for p in model.parameters())


def rank_main(rank: int, size: int, port: int, way: str, folder: str, args: dict, out: str):
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    import torch
    import torch.distributed as dist

    from flywheel.core.trainer_settings import AlgorithmSettings, BatchSettings
    from flywheel.trainer.distributed import World, exit_distributed
    from flywheel.trainer.fsdp import shard_policy
    from flywheel.trainer.fsdp_load import load_sharded_policy
    from flywheel.trainer.sources import FakeSource
    from flywheel.trainer.step import StepConfig, prepare_batch, train_step
    from flywheel.trainer.weights import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    world = World(rank, size)
    path = Path(folder)
    dist.barrier()
    row: dict[str, float | str] = {"rank": rank, "way": way}
    base = status_mib()
    row["baseline_mib"] = base["rss"]
    sampler = PeakSampler()
    t0 = time.perf_counter()
    if way == "old":
        model = load_model(path)
        trained = shard_policy(model)
        reference = load_model(path).requires_grad_(False).eval()
    else:
        model, trained = load_sharded_policy(path, torch.device("cpu"))
        reference = load_sharded_policy(path, torch.device("cpu"), frozen=True)[1]
    dist.barrier()
    row["load_s"] = time.perf_counter() - t0
    over = {k: v - base[k] for k, v in sampler.read().items()}
    row |= {"load_anon": over["anon"], "load_file": over["file"], "load_rss": over["rss"]}
    now = {k: v - base[k] for k, v in status_mib().items()}
    row |= {"kept_anon": now["anon"], "kept_file": now["file"]}
    if args["samples"]:
        source = FakeSource(model.config.vocab_size, 2, args["tokens"], args["tokens"])
        samples = [e.sample for e in source.read(args["samples"], 0)]
        groups = [samples[i : i + 2] for i in range(0, len(samples), 2)]
        cfg = StepConfig(
            algorithm=AlgorithmSettings(kl_coef=0.1), batch=BatchSettings(micro_batch_size=1)
        )
        batch, _ = prepare_batch(groups, cfg)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-6)
        sampler.reset()
        t0 = time.perf_counter()
        result = train_step(trained, optimizer, batch, cfg, reference=reference, world=world)
        row["step_s"] = time.perf_counter() - t0
        over = {k: v - base[k] for k, v in sampler.read().items()}
        row |= {"step_anon": over["anon"], "step_file": over["file"], "step_rss": over["rss"]}
        row["loss"] = result.metrics.get("loss/total", float("nan"))
    sampler.stop.set()
    Path(out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    exit_distributed(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_way(way: str, folder: Path, args: argparse.Namespace, tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    outs = [str(tmp / f"{way}_{folder.name}_{r}.json") for r in range(args.ranks)]
    mp.start_processes(
        rank_main_entry,
        args=(args.ranks, free_port(), way, str(folder), vars(args), outs),
        nprocs=args.ranks,
        join=True,
        start_method="spawn",
    )
    return [json.loads(Path(o).read_text()) for o in outs]


def rank_main_entry(rank, size, port, way, folder, args, outs):
    rank_main(rank, size, port, way, folder, args, outs[rank])


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp_memory_") as tmp_name:
        tmp = Path(tmp_name)
        params = write_models(tmp, args.size, args.dtypes)
        fp32_mib = params * 4 / 2**20
        print(
            f"model: random Llama {args.size} ({params / 1e6:.1f}M parameters, fp32 "
            f"{fp32_mib:.0f} MiB; a 1/{args.ranks} shard {fp32_mib / args.ranks:.0f} MiB), "
            f"policy + KL reference, {args.ranks} ranks (gloo, CPU)"
        )
        runs = {
            (dtype, way): run_way(way, tmp / dtype, args, tmp)
            for dtype in args.dtypes
            for way in args.ways
        }
    report(runs)


def report(runs: dict[tuple[str, str], list[dict]]) -> None:
    cols = ["load_anon", "load_file", "kept_anon", "kept_file", "step_anon", "step_file"]
    print(
        "\nMiB over each rank's baseline (anon: private memory; file: mapped file pages, "
        "page cache shared by the ranks); peaks except kept_* (resident after loading)"
    )
    print("file way  rank baseline" + "".join(f"{c:>10}" for c in cols) + "    load_s    step_s")
    for (dtype, way), ranks in runs.items():
        for r in ranks:
            values = "".join(f"{r.get(c, float('nan')):10.0f}" for c in cols)
            times = f"{r['load_s']:10.1f}{r.get('step_s', float('nan')):10.1f}"
            print(f"{dtype:4} {way:4} {r['rank']:4} {r['baseline_mib']:8.0f}{values}{times}")
    for dtype in dict.fromkeys(d for d, _ in runs):
        if (dtype, "old") not in runs or (dtype, "new") not in runs:
            continue
        print(f"\n{dtype} file, old / new per rank:")
        for old, new in zip(runs[dtype, "old"], runs[dtype, "new"], strict=True):
            ratios = ", ".join(
                f"{c} {old[c] / new[c]:.2f}x"
                for c in ("load_anon", "kept_anon", "step_anon", "load_rss", "step_rss")
                if c in old and new.get(c, 0) > 0
            )
            print(f"  rank {old['rank']}: {ratios}")
        pairs = list(zip(runs[dtype, "old"], runs[dtype, "new"], strict=True))
        if all("loss" in o and "loss" in n for o, n in pairs):
            same = all(abs(o["loss"] - n["loss"]) < 1e-4 for o, n in pairs)
            print(f"  same step loss both ways: {same}")


if __name__ == "__main__":
    main()
