"""Data parallelism at world size 2 on CPU (gloo), in-process ranks: FSDP2 (`fully_shard`) and
the explicit gradient all-reduce both take the same optimizer step as one process on the same
global batch, and report the same global loss and token statistics."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flywheel.core.trainer_settings import BatchSettings
from flywheel.trainer.distributed import World, exit_distributed
from flywheel.trainer.fsdp import ShardedCheckpointer, full_state_dict, shard_policy
from flywheel.trainer.step import StepConfig, prepare_batch, train_step
from flywheel.trainer.weights import load_model

from ..unit.trainer.factories import make_sample

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LENGTHS = [(3, 9), (20, 30), (4, 2), (6, 14), (10, 3)]
"""(prompt, completion) of 5 samples: with micro-batches of 2, rank 0 (rows 0, 2, 4) runs two
micro-batches and rank 1 (rows 1, 3) one, so FSDP2's pass equalization is exercised."""
REPORTED = [
    "loss/total",
    "loss/pg",
    "entropy/mean",
    "logprob/abs_diff_mean",
    "logprob/abs_diff/max",
    "batch/micro_batches",
    "grad/norm",
]
"""Compared with one process. grad/norm (before clipping) checks the gradient's scale: AdamW's
first step, about lr * sign(g), would not show gradients averaged instead of summed."""


def batch_and_config(shared_prompt: bool = False):
    """The 5 samples and the step config; `shared_prompt`: every sample has the same
    18-token prompt (so `layout = "shared_prefix"` runs it once per micro-batch)."""
    samples = [
        make_sample(
            prompt_len=18 if shared_prompt else p,
            completion_len=c,
            reward=float(i in (1, 3)),
            seed=i,
            temperature=0.8,
            logprob=-2.0,
            group_id="g",
        )
        for i, (p, c) in enumerate(LENGTHS)
    ]
    if shared_prompt:
        for sample in samples:
            sample.token_ids[:18] = samples[0].token_ids[:18]
    cfg = StepConfig(batch=BatchSettings(micro_batch_size=2))
    batch, _ = prepare_batch([samples], cfg)
    return batch, cfg


def one_step(model_dir: Path, strategy: str, world: World | None):
    """One train_step; returns (the full state dict, the step metrics). `fsdp2_packed`:
    FSDP2 with packed micro-batches (compared with one padded process); `fsdp2_shared`: FSDP2
    with shared-prefix micro-batches on samples sharing their prompt (`none_shared`: one
    process, same layout; tests/unit/trainer/test_shared_prefix.py compares it with padded)."""
    torch.manual_seed(0)
    model = load_model(model_dir)
    variant = ""
    if strategy.endswith(("_packed", "_shared")):
        strategy, variant = strategy.rsplit("_", 1)
    trained = shard_policy(model) if strategy == "fsdp2" else model
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    batch, cfg = batch_and_config(shared_prompt=variant == "shared")
    layout = {"packed": "packed", "shared": "shared_prefix"}.get(variant, "padded")
    if strategy == "none" and variant != "shared":
        layout = "padded"
    cfg = dataclasses.replace(cfg, batch=BatchSettings(micro_batch_size=2, layout=layout))
    result = train_step(trained, optimizer, batch, cfg, world=world)
    assert not result.skipped, result
    if strategy != "fsdp2":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, result.metrics
    # the weights rank 0 exports (pushes, model.safetensors): gathered from every rank
    return full_state_dict(model), result.metrics


def rank_main(rank: int, size: int, port: int, model_dir: str, strategy: str, out: str) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        state, metrics = one_step(Path(model_dir), strategy, World(rank, size))
        if rank == 0:
            torch.save({"state": state, "metrics": metrics}, out)
    finally:
        dist.destroy_process_group()
    # as a torchrun rank does: gloo threads torn down at interpreter exit abort the process
    # now and then (SIGABRT), which mp.spawn would report as a failed rank
    exit_distributed(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["fsdp2", "all_reduce", "fsdp2_packed", "fsdp2_shared"])
def test_two_ranks_take_the_one_process_step(tiny_model_dir, tmp_path, strategy):
    single = "none_shared" if strategy.endswith("_shared") else "none"
    single_state, single_metrics = one_step(tiny_model_dir, single, None)
    out = tmp_path / "rank0.pt"
    mp.spawn(
        rank_main,
        args=(2, free_port(), str(tiny_model_dir), strategy, str(out)),
        nprocs=2,
        join=True,
    )
    two = torch.load(out, weights_only=False)
    initial = load_model(tiny_model_dir).state_dict()
    # Summation order differs between one process and two ranks; AdamW's first step is about
    # lr * g / (|g| + eps), so elements with |g| near eps (1e-8) may move by a few 1e-6
    # differently: 2e-5 is 0.2% of the lr-sized (1e-2) update.
    assert two["state"].keys() == single_state.keys()
    for name, tensor in single_state.items():
        torch.testing.assert_close(two["state"][name], tensor, atol=2e-5, rtol=0, msg=name)
    moved = (
        (single_state["model.embed_tokens.weight"] - initial["model.embed_tokens.weight"])
        .abs()
        .max()
    )
    assert float(moved) > 1e-3  # the step moved the weights by about lr
    # metrics are global: the same as one process over the whole batch (micro-batches: one
    # process runs 3 of 2 rows; ranks run 2 + 1)
    for key in REPORTED:
        assert two["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
    assert two["metrics"]["tokens/trained"] == single_metrics["tokens/trained"]


def local_state(trained, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters and of AdamW's moments (and step), as CPU copies."""
    out = {f"param/{n}": p.to_local().detach().clone() for n, p in trained.named_parameters()}
    for i, entry in enumerate(optimizer.state.values()):
        for key, value in entry.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"optim/{i}/{key}"] = local.detach().clone()
    return out


def checkpoint_rank(rank: int, size: int, port: int, model_dir: str, folder: str) -> None:
    """Step, save sharded (async), step again while the shards are written, then restore into
    a fresh policy and optimizer: its shards equal those right after the first step."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        world = World(rank, size)
        batch, cfg = batch_and_config()
        trained = shard_policy(load_model(Path(model_dir)))
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        checkpointer = ShardedCheckpointer(Path(folder), trained, optimizer)
        assert not train_step(trained, optimizer, batch, cfg, world=world).skipped
        saved = local_state(trained, optimizer)
        writing = checkpointer.save(1)
        assert not train_step(trained, optimizer, batch, cfg, world=world).skipped  # meanwhile
        moved = local_state(trained, optimizer)
        writing.result()
        assert checkpointer.complete(1)

        fresh = shard_policy(load_model(Path(model_dir)))
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        restorer = ShardedCheckpointer(Path(folder), fresh, fresh_optimizer)
        assert restorer.load(1)  # with its optimizer state
        restored = local_state(fresh, fresh_optimizer)
        assert restored.keys() == saved.keys() and len(restored) > 20
        for key, value in saved.items():
            torch.testing.assert_close(restored[key], value, atol=0, rtol=0, msg=key)
        differs = [k for k in saved if k.startswith("param/") and not moved[k].equal(saved[k])]
        assert differs, "the second step changed the live parameters, not the checkpoint"
        torch.save(
            {"keys": sorted(saved), "numel": sum(v.numel() for v in saved.values())},
            Path(folder) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
    exit_distributed(0)


def test_sharded_checkpoint_is_written_per_rank_and_restores_exactly(tiny_model_dir, tmp_path):
    mp.spawn(
        checkpoint_rank,
        args=(2, free_port(), str(tiny_model_dir), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    folder = tmp_path / "sharded" / "step_00000001"
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one file per rank, no gathered copy
    assert (folder / ".metadata").is_file()
    # each rank wrote its own part: every element of both ranks' shards (parameters, two AdamW
    # moments: fp32, 4 bytes each) is on disk once, and neither file holds the whole state
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["keys"] == ranks[1]["keys"]
    elements = sum(r["numel"] for r in ranks)
    full = sum(p.numel() for p in load_model(tiny_model_dir).parameters())  # tied: once
    assert elements >= 3 * full * 0.95  # the ranks' shards together: params + 2 moments
    sizes = [(folder / name).stat().st_size for name in shards]
    assert sum(sizes) >= 4 * elements
    assert all(size < 0.75 * 4 * elements for size in sizes), sizes
