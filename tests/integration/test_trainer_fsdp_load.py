"""FSDP2 loading without a whole model on any rank (fsdp_load.py), at world size 2 on CPU (gloo),
in-process ranks: the shards loaded straight from the safetensors (each rank its own rows, or
rank 0 broadcasting) gather to exactly the weights `from_pretrained` loads; the policy and the
KL reference that `build_policy` loads this way take the same step as the old way (whole model
on every rank, then sharded; a whole reference on every rank); the reference is sharded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM

from flywheel.core.settings import load_settings
from flywheel.engine.convert import build_tiny_model
from flywheel.trainer.distributed import World, exit_distributed
from flywheel.trainer.fsdp import ShardedPolicy, full_state_dict, shard_policy
from flywheel.trainer.fsdp_load import load_sharded_policy
from flywheel.trainer.policy import build_policy
from flywheel.trainer.step import StepConfig, build_optimizer, train_step
from flywheel.trainer.weights import load_model

from .test_trainer_fsdp import batch_and_config, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CPU = torch.device("cpu")


def start(rank: int, size: int, port: int) -> World:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    return World(rank, size)


def shard_report(root: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (this rank's elements, the whole parameter's); raises if one is not a dim-0
    shard over the 2 ranks."""
    out = {}
    for name, p in root.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        out[name] = (p.to_local().numel(), p.numel())
    return out


def load_rank(rank: int, size: int, port: int, dirs: list[str], out: str) -> None:
    """Every folder, both ways: the gathered weights, buffers and shard sizes (rank 0 saves)."""
    start(rank, size, port)
    try:
        result = {}
        for folder in dirs:
            for way in ("per_rank", "rank0"):
                model, root = load_sharded_policy(Path(folder), CPU, way=way)
                result[(folder, way)] = {
                    "state": full_state_dict(model),
                    "buffers": {n: b.clone() for n, b in model.named_buffers()},
                    "shards": shard_report(root),
                    "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                    "generation": model.generation_config.to_dict(),
                }
            model, reference = load_sharded_policy(Path(folder), CPU, frozen=True)
            ids_BT = torch.tensor([[1, 2, 3]])
            with torch.no_grad():
                reference(ids_BT, torch.ones_like(ids_BT), torch.ones(1), ids_BT > 1)
            result[(folder, "reference")] = {
                "shards": shard_report(reference),  # DTensors again after its forward
                "grad": any(p.requires_grad for p in reference.parameters()),
                "training": model.training,
            }
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()
    exit_distributed(0)


def untied_bf16_model(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model with its own lm_head (untied), saved in bf16."""
    model = load_model(tiny_model_dir)
    model.config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    untied.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(torch.randn_like(untied.lm_head.weight) * 0.2)
    untied.to(torch.bfloat16).save_pretrained(out)
    return out


def test_sharded_load_gathers_to_the_full_model_bit_for_bit(tiny_model_dir, tmp_path):
    untied = untied_bf16_model(tiny_model_dir, tmp_path / "untied_bf16")
    dirs = [str(tiny_model_dir), str(untied)]
    out = tmp_path / "loaded.pt"
    mp.spawn(load_rank, args=(2, free_port(), dirs, str(out)), nprocs=2, join=True)
    loaded = torch.load(out, weights_only=False)
    for folder in dirs:
        full = load_model(Path(folder))  # from_pretrained, fp32 (a bf16 file is upcast alike)
        expected = full.state_dict()
        tied = folder == str(tiny_model_dir)
        for way in ("per_rank", "rank0"):
            got = loaded[(folder, way)]
            assert got["tied"] is tied, (folder, way)
            # generation_config.json read as from_pretrained does (checkpoints write it back)
            assert got["generation"] == full.generation_config.to_dict(), (folder, way)
            assert got["state"].keys() == expected.keys(), (folder, way)
            for name, tensor in expected.items():
                assert got["state"][name].dtype == torch.float32
                assert torch.equal(got["state"][name], tensor), (folder, way, name)
            for name, buffer in full.named_buffers():  # rotary frequencies, not left empty
                assert torch.equal(got["buffers"][name], buffer), (folder, way, name)
            # each rank holds half of every parameter: 2-layer tiny Llama, vocab 49152 x
            # hidden 64 embedding = 3,145,728 elements, 1,572,864 per rank
            shards = got["shards"]
            embedding = shards["policy.model.embed_tokens.weight"]
            assert embedding == (49152 * 64 // 2, 49152 * 64), embedding
            assert ("policy.lm_head.weight" in shards) is not tied  # tied: one parameter
            assert all(2 * local <= whole + 64 for local, whole in shards.values())
        reference = loaded[(folder, "reference")]
        assert reference["shards"] == loaded[(folder, "per_rank")]["shards"]
        assert not reference["grad"] and not reference["training"]
    # the untied model's head is not its embedding (so the check above can fail)
    untied_state = load_model(untied).state_dict()
    assert not torch.equal(
        untied_state["lm_head.weight"], untied_state["model.embed_tokens.weight"]
    )


KL = {"kl_coef": 0.5, "kl_estimator": "k3"}


def step_rank(
    rank: int, size: int, port: int, model_dir: str, ref_dir: str, folder: str, out: str
) -> None:
    """One KL-regularized step the old way and the new way (`build_policy`), same rank."""
    world = start(rank, size, port)
    try:
        batch, cfg = batch_and_config()
        cfg = StepConfig(algorithm=cfg.algorithm.model_copy(update=KL), batch=cfg.batch)
        settings = load_settings(
            trainer={
                "model_path": model_dir,
                "device": "cpu",
                "precision": "fp32",
                "optim": {"lr": 1e-2},
                "algorithm": KL | {"reference_model_path": ref_dir},
                "batch": {"micro_batch_size": 2},
                "checkpoint": {"dir": folder},
                "distributed": {"strategy": "fsdp2"},
            }
        )
        # old: the whole model on this rank, then sharded; a whole reference on this rank
        torch.manual_seed(0)
        old_model = load_model(Path(model_dir))
        old_root = shard_policy(old_model)
        old_reference = load_model(Path(ref_dir)).requires_grad_(False).eval()
        old_optimizer = build_optimizer(old_model, settings.trainer.optim)
        old = train_step(old_root, old_optimizer, batch, cfg, reference=old_reference, world=world)

        torch.manual_seed(0)
        policy = build_policy(settings, world)
        assert isinstance(policy.trained, ShardedPolicy)
        assert isinstance(policy.reference, ShardedPolicy)
        new = train_step(
            policy.trained, policy.optimizer, batch, cfg, reference=policy.reference, world=world
        )
        result = {
            "old": (full_state_dict(old_model), old.metrics),
            "new": (full_state_dict(policy.model), new.metrics),
            "reference_shards": shard_report(policy.reference),
        }
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()
    exit_distributed(0)


def test_step_with_sharded_loading_and_reference_equals_the_old_loading(tiny_model_dir, tmp_path):
    # a reference other than the policy (another random tiny Llama): the KL term and its
    # gradient are not zero, so a wrong reference forward would show
    ref_dir = build_tiny_model(tmp_path / "reference", seed=1)
    out = tmp_path / "step.pt"
    args = (2, free_port(), str(tiny_model_dir), str(ref_dir), str(tmp_path / "ckpt"), str(out))
    mp.spawn(step_rank, args=args, nprocs=2, join=True)
    result = torch.load(out, weights_only=False)
    (old_state, old_metrics), (new_state, new_metrics) = result["old"], result["new"]
    # rank 0 runs two micro-batches, rank 1 one and a null pass (LENGTHS): the sharded
    # reference's forward runs in the null pass too, or the collectives would not match
    assert old_metrics["batch/micro_batches"] == new_metrics["batch/micro_batches"] == 3
    assert new_metrics["loss/kl"] > 1e-3
    for key in ("loss/total", "loss/pg", "loss/kl", "grad/norm", "entropy/mean"):
        assert new_metrics[key] == pytest.approx(old_metrics[key], rel=1e-6, abs=1e-7), key
    initial = load_model(tiny_model_dir).state_dict()
    assert new_state.keys() == old_state.keys() == initial.keys()
    for name, tensor in old_state.items():
        torch.testing.assert_close(new_state[name], tensor, msg=name)  # fp32 tolerance
    moved = (new_state["model.norm.weight"] - initial["model.norm.weight"]).abs().max()
    assert float(moved) > 1e-3  # the step moved the weights (by about lr = 1e-2)
    # the reference is sharded: every parameter a dim-0 DTensor holding half its elements
    shards = result["reference_shards"]
    assert len(shards) == 2 * 9 + 2  # 9 tensors per layer, embedding (tied head), final norm
    assert all(2 * local <= whole + 64 for local, whole in shards.values())
