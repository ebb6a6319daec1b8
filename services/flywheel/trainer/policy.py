"""The policy a trainer process trains: loading (or resuming) the model with LoRA, the
reference, AdamW and the LR schedule; the checks of settings the step cannot run with; the
weight pusher; and the loop of a rank > 0 under torchrun."""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from flywheel.core.codec import decode_sample
from flywheel.core.paths import resolve_model_path
from flywheel.core.settings import FlywheelSettings
from flywheel.trainer.distributed import World
from flywheel.trainer.fleet_push import shared_fleet
from flywheel.trainer.fsdp import ShardedPolicy
from flywheel.trainer.leases import LeaseKeeper, NullLeases
from flywheel.trainer.precision import native_bf16, resolve_precision
from flywheel.trainer.sources import SampleSource
from flywheel.trainer.step import (
    StepConfig,
    build_optimizer,
    build_scheduler,
    prepare_batch,
    train_step,
)
from flywheel.trainer.telemetry import MetricsSink, TrainerStatus
from flywheel.trainer.weights import (
    Checkpoint,
    CheckpointStore,
    WeightPusher,
    WeightsStore,
    load_model,
    load_training_state,
    recompute_activations,
    resolve_device,
)

log = logging.getLogger(__name__)


@dataclass
class TrainerParts:
    """Everything the loop uses, built by `build_trainer` (tests build their own)."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    consumer: SampleSource
    """The source of entries (redis stream, replay or fake)."""
    pusher: WeightPusher
    store: CheckpointStore
    leases: LeaseKeeper | NullLeases
    sink: MetricsSink
    status: TrainerStatus
    version: int
    """Committed optimizer steps of the loaded weights (0 = the initial model)."""
    reference: PreTrainedModel | ShardedPolicy | None = None
    """Frozen reference policy for the KL term (None when kl_coef is 0); under fsdp2 sharded
    (its `ShardedPolicy` root)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    world: World | None = None
    """Data-parallel ranks (this is rank 0) or None."""
    trained: torch.nn.Module | None = None
    """What `train_step` runs: the FSDP2 root (`ShardedPolicy`) under fsdp2, else None (the
    model itself)."""
    sharded: Any = None
    """Under fsdp2 the `ShardedCheckpointer` (every rank writes its own shards), else None."""


@dataclass
class Policy:
    """The trained model and what its updates need (the same on every rank)."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: PreTrainedModel | ShardedPolicy | None
    latest: Checkpoint | None
    store: CheckpointStore
    source_dir: Path
    trained: torch.nn.Module | None = None
    """The FSDP2 root under fsdp2 (what train_step runs), else None."""
    sharded: Any = None
    """The `ShardedCheckpointer` under fsdp2, else None."""


def build_policy(settings: FlywheelSettings, world: World | None = None) -> Policy:
    """Load the newest checkpoint (or the initial model) with LoRA, reference, AdamW and the LR
    schedule, and restore their training state. With `world` and `distributed_strategy =
    "fsdp2"`, the model and the KL reference are built on the meta device, sharded (fsdp.py)
    and each rank loads only its shards (fsdp_load.py); AdamW is built over the shards.

    Raises:
        ValueError: fsdp2 with LoRA, the distributed weight push, or algorithm parts that run
            their own forward through the model; top-k distillation without teacher top-k.
    """
    s = settings.trainer
    bf16, why = resolve_precision(s.precision, resolve_device(s.device))
    emulated = bf16 and not native_bf16(resolve_device(s.device))
    (log.warning if emulated else log.info)("trainer precision: %s", why)
    fsdp = world is not None and s.distributed.strategy == "fsdp2"
    if fsdp:
        check_fsdp_settings(settings)
    check_teacher_inputs(settings)
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    source_dir = resolve_model_path(s.model_path or settings.engine.model_path)
    store = CheckpointStore(Path(s.checkpoint.dir), s.checkpoint.keep, source_dir)
    latest = store.latest()
    weights_path = latest.path if latest else source_dir
    trained = None
    if fsdp:  # built on the meta device, each rank loading only its shards (fsdp_load.py)
        from flywheel.trainer.fsdp_load import load_sharded_policy  # noqa: PLC0415

        model, trained = load_sharded_policy(
            weights_path,
            resolve_device(s.device),
            gradient_checkpointing=s.gradient_checkpointing,
        )
        assert world is not None  # fsdp is only chosen with a world
        log.info("rank %d: model sharded with FSDP2 over %d ranks", world.rank, world.size)
    else:
        model = load_model(weights_path, s.device)
        if s.gradient_checkpointing:
            recompute_activations(model)
    if s.lora.rank > 0:
        from flywheel.trainer.lora import add_lora  # noqa: PLC0415 (peft is optional)

        model = add_lora(model, s.lora)
    reference: PreTrainedModel | ShardedPolicy | None = None
    if s.algorithm.kl_coef > 0:
        ref_path = (
            resolve_model_path(s.algorithm.reference_model_path)
            if s.algorithm.reference_model_path
            else (source_dir)
        )
        if fsdp:  # sharded like the policy: no rank holds a whole copy
            from flywheel.trainer.fsdp_load import load_sharded_policy  # noqa: PLC0415

            reference = load_sharded_policy(ref_path, resolve_device(s.device), frozen=True)[1]
        else:
            reference = load_model(ref_path, s.device).requires_grad_(False).eval()
        log.info("KL reference policy (frozen) loaded from %s", ref_path)
    optimizer = build_optimizer(model, s.optim)
    scheduler = build_scheduler(optimizer, s.optim)
    sharded = None
    if trained is not None:
        from flywheel.trainer.fsdp import ShardedCheckpointer  # noqa: PLC0415

        sharded = ShardedCheckpointer(Path(s.checkpoint.dir), trained, optimizer)
    if latest is not None:
        restore_training_state(optimizer, scheduler, latest, trained, sharded)
    return Policy(
        model, optimizer, scheduler, reference, latest, store, source_dir, trained, sharded
    )


def check_teacher_inputs(settings: FlywheelSettings) -> None:
    """Refuse a selected part that reads the teacher's top-k when the teacher keeps none: the
    Samples would carry no top-k and the term would silently add 0.

    Raises:
        ValueError: a top-k distillation regularizer with `[teacher] top_k = 0`.
    """
    algo = StepConfig.from_settings(settings.trainer).algo
    if algo.needs_teacher_topk and settings.teacher.top_k == 0:
        raise ValueError(
            "a selected regularizer (distill_topk) reads the teacher's top-k "
            "logprobs, but [teacher] top_k = 0 keeps none: set [teacher] "
            "enabled = true and top_k > 0 (e.g. 8), or remove the regularizer"
        )


def check_fsdp_settings(settings: FlywheelSettings) -> None:
    """Refuse what fsdp2 does not combine with (see fsdp.py).

    Raises:
        ValueError: LoRA, push.mode distributed, or an algorithm part with its own forward.
    """
    s = settings.trainer
    algo = StepConfig.from_settings(s).algo
    if s.lora.rank > 0:
        raise ValueError(
            "trainer.distributed.strategy = 'fsdp2' with trainer.lora.rank > 0 is not supported"
        )
    if s.push.mode == "distributed":
        raise ValueError(
            "trainer.distributed.strategy = 'fsdp2' pushes from disk; set "
            "trainer.push.mode = 'disk'"
        )
    if algo.needs_topk or algo.needs_entropy_pass:
        raise ValueError(
            "trainer.distributed.strategy = 'fsdp2' cannot run algorithm parts with their "
            "own forward (top-k regularizers, entropy-scored token weights)"
        )


def build_pusher(settings: FlywheelSettings) -> Any:
    """The disk pusher, wrapped by the distributed one when `push.mode = "distributed"`.

    Raises:
        ValueError: `push.tp_sizes` given without one entry per engine.
    """
    s = settings.trainer
    disk = WeightPusher(
        settings.trainer_engine_urls(),
        timeout_s=s.push.timeout_s,
        attempts=s.push.attempts,
        pause=s.push.pause,
        engine_deadline_s=settings.fleet.push_deadline_s,
        fleet=shared_fleet(settings),  # the distributed group follows it too
        refresh_s=settings.fleet.refresh_s,
    )
    if s.push.mode == "disk":
        return disk
    from flywheel.trainer.distributed_push import DistributedPusher  # noqa: PLC0415

    # the broadcast snapshot, written for an engine that joins between pushes
    source_dir = resolve_model_path(s.model_path or settings.engine.model_path)
    joiners = WeightsStore(Path(s.checkpoint.dir) / "joiners", source_dir)
    # Only a cache of the snapshot kept in memory, which a starting trainer has not: folders an
    # earlier run left would outrank this run's versions, and pruning would delete those first.
    if joiners.root.exists():
        shutil.rmtree(joiners.root)
        log.info("deleted the weight folders an earlier run left in %s", joiners.root)

    return DistributedPusher(
        disk,
        master_address=s.push.master_address,
        master_port=s.push.master_port,
        backend="nccl" if torch.cuda.is_available() and s.device != "cpu" else "gloo",
        timeout_s=s.push.timeout_s,
        tp_sizes=s.push.tp_sizes,
        bucket_bytes=int(s.push.bucket_mb * 1024**2),
        pause=s.push.pause,
        joiners=joiners,
    )


def run_follower(settings: FlywheelSettings, world: World) -> int:
    """A rank > 0 under torchrun: train the batches rank 0 broadcasts until it says stop;
    returns the steps taken."""
    policy = build_policy(settings, world)
    cfg = StepConfig.from_settings(settings.trainer)
    steps = 0
    while True:
        message = world.broadcast(None)
        if message[0] == "stop":
            if policy.sharded is not None:
                policy.sharded.wait()
            return steps
        if message[0] == "checkpoint":  # rank 0 checkpoints: every rank writes its shards
            policy.sharded.save(message[1], settings.trainer.checkpoint.save_optimizer)
            continue
        _, payloads, treatments = message
        groups = [[decode_sample(p) for p in group] for group in payloads]
        batch, _ = prepare_batch(groups, cfg, treatments)
        result = train_step(
            cast(PreTrainedModel, policy.trained or policy.model),
            policy.optimizer,
            batch,
            cfg,
            reference=policy.reference,
            scheduler=policy.scheduler,
            world=world,
        )
        if not result.skipped and policy.trained is not None:  # rank 0 exports the weights
            from flywheel.trainer.fsdp import full_state_dict  # noqa: PLC0415

            full_state_dict(policy.model)
        steps += not result.skipped


def restore_training_state(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    latest: Checkpoint,
    trained: torch.nn.Module | None = None,
    sharded: Any = None,
) -> None:
    """AdamW and scheduler state of `latest`, where it has them (logged when not). Under
    FSDP2 (`trained` is the root) every rank loads its own shards of the model and AdamW
    (`sharded`, collective); a checkpoint written before sharding has its full AdamW state
    sharded onto this rank instead."""
    optimizer_state = None
    if sharded is not None and sharded.complete(latest.step):
        if not sharded.load(latest.step):
            log.warning("checkpoint %s has no optimizer state; AdamW starts fresh", latest.path)
    elif (optimizer_state := load_training_state(latest.path, "optimizer")) is None:
        log.warning("checkpoint %s has no optimizer state; AdamW starts fresh", latest.path)
    elif trained is not None:
        from flywheel.trainer.fsdp import load_full_optimizer_state  # noqa: PLC0415

        load_full_optimizer_state(trained, optimizer, optimizer_state)
    else:
        optimizer.load_state_dict(optimizer_state)
    scheduler_state = load_training_state(latest.path, "scheduler")
    if scheduler_state is not None and scheduler is not None:
        scheduler.load_state_dict(scheduler_state)


def training_state(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    save_optimizer: bool,
    sharded: bool = False,
) -> dict[str, Any]:
    """What a checkpoint keeps under `training/` (`restore_training_state` reads it back):
    AdamW state (not under FSDP2, `sharded`: every rank's shards are in the sharded
    checkpoint), the RNG states and the scheduler's; {} when `save_optimizer` is off."""
    if not save_optimizer:
        return {}
    state: dict[str, Any] = {
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    if not sharded:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state
