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

from flywheel.trainer.distributed import World, exit_distributed
from flywheel.trainer.fsdp import (
    full_state_dict,
    gather_checkpoint,
    load_full_optimizer_state,
    shard_policy,
)
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


def batch_and_config():
    samples = [
        make_sample(
            prompt_len=p,
            completion_len=c,
            reward=float(i in (1, 3)),
            seed=i,
            temperature=0.8,
            logprob=-2.0,
            group_id="g",
        )
        for i, (p, c) in enumerate(LENGTHS)
    ]
    cfg = StepConfig(micro_batch_size=2)
    batch, _ = prepare_batch([samples], cfg)
    return batch, cfg


def one_step(model_dir: Path, strategy: str, world: World | None):
    """One train_step; returns (the full state dict, the step metrics). `fsdp2_packed`:
    FSDP2 with packed micro-batches (compared with one padded process)."""
    torch.manual_seed(0)
    model = load_model(model_dir)
    packed = strategy == "fsdp2_packed"
    strategy = "fsdp2" if packed else strategy
    trained = shard_policy(model) if strategy == "fsdp2" else model
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    batch, cfg = batch_and_config()
    cfg = dataclasses.replace(cfg, packed=packed)
    result = train_step(trained, optimizer, batch, cfg, world=world)
    assert not result.skipped, result
    if strategy != "fsdp2":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, result.metrics
    # the checkpoint path: full weights and AdamW state gathered on every rank; a fresh
    # optimizer restored from that full state gathers back to the same state (resume)
    state, optim = gather_checkpoint(model, optimizer, trained, with_optimizer=True)
    restored = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    load_full_optimizer_state(trained, restored, optim)
    _, again = gather_checkpoint(model, restored, trained, with_optimizer=True)
    if world is None or world.main:  # the full optimizer state lands on rank 0 only
        moments = [(name, key) for name, entry in optim["state"].items() for key in entry]
        assert len(moments) > 10
        for name, key in moments:
            torch.testing.assert_close(again["state"][name][key], optim["state"][name][key])
    assert full_state_dict(model).keys() == state.keys()
    return state, result.metrics


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


@pytest.mark.parametrize("strategy", ["fsdp2", "all_reduce", "fsdp2_packed"])
def test_two_ranks_take_the_one_process_step(tiny_model_dir, tmp_path, strategy):
    single_state, single_metrics = one_step(tiny_model_dir, "none", None)
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
