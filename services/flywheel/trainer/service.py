"""The trainer loop (docs/architecture.md):

    read source -> admit into groups -> (enough ready) -> stale: drop / down-weight / IS-correct
    -> advantages -> optimizer step -> checkpoint -> push weights to every engine -> ack -> metrics

Delivery (exactly once with respect to the source): an entry is acked only after the step that
used it is committed to a checkpoint. The checkpoint records the entry ids and sample_ids it
trained on, the source position, and the AdamW, scheduler and RNG state, so a trainer that
crashes between checkpoint and ack acks them when it resumes (and pushes that checkpoint again)
instead of training them twice, and one that crashes mid-step leaves its entries pending, to be
read again (by itself under a stable consumer name, or by XAUTOCLAIM after `min_idle_ms`).
Sample ids already trained are dropped as duplicates (idempotency by `sample_id`). Dropped
samples are acked or dead-lettered at once (see `groups.DropReason`), each counted and logged.

Weight push: every `push_every` committed steps, to every engine. An engine that fails all its
attempts is counted (`flywheel_trainer_weight_push_failures_total{engine}`), logged, shown in
`/status` as behind, and given the newest checkpoint again at the next step; if every engine
fails, the trainer stops with the error (a restart pushes the newest checkpoint again).

Redis outages: a read that fails is retried with backoff (0.5 s doubling to 10 s) until Redis
answers again, each failure counted (`flywheel_trainer_redis_errors_total`) and logged; acks and
dead letters of entries already taken from the stream are retried the same way, so no entry is
left pending and held once Redis is back.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter as Tally
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch
from transformers import PreTrainedModel

from flywheel.core.codec import decode_sample
from flywheel.core.errors import UpstreamError
from flywheel.core.paths import resolve_model_path
from flywheel.core.settings import FlywheelSettings
from flywheel.core.streams import StreamEntry
from flywheel.trainer.distributed import World
from flywheel.trainer.groups import Drop, DropReason, Group, GroupAssembler
from flywheel.trainer.leases import LeaseKeeper, NullLeases
from flywheel.trainer.redis_retry import retry_redis
from flywheel.trainer.sources import FakeSource, SampleSource, build_source
from flywheel.trainer.staleness import StalenessPolicy
from flywheel.trainer.step import (
    StepConfig,
    build_optimizer,
    build_scheduler,
    native_bf16,
    prepare_batch,
    resolve_precision,
    train_step,
)
from flywheel.trainer.telemetry import (
    SAMPLE_LAG,
    MetricsSink,
    TrainerStatus,
    build_sink,
    record_push,
)
from flywheel.trainer.weights import (
    Checkpoint,
    CheckpointStore,
    WeightPusher,
    load_model,
    load_training_state,
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
    reference: PreTrainedModel | None = None
    """Frozen reference policy for the KL term (None when kl_coef is 0)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    world: World | None = None
    """Data-parallel ranks (this is rank 0) or None."""
    trained: torch.nn.Module | None = None
    """What `train_step` runs: the FSDP2 root (`ShardedPolicy`) under fsdp2, else None (the
    model itself)."""


@dataclass
class Policy:
    """The trained model and what its updates need (the same on every rank)."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: PreTrainedModel | None
    latest: Checkpoint | None
    store: CheckpointStore
    source_dir: Path
    trained: torch.nn.Module | None = None
    """The FSDP2 root under fsdp2 (what train_step runs), else None."""


def build_policy(settings: FlywheelSettings, world: World | None = None) -> Policy:
    """Load the newest checkpoint (or the initial model) with LoRA, reference, AdamW and the LR
    schedule, and restore their training state. With `world` and `distributed_strategy =
    "fsdp2"`, the model is sharded (fsdp.py) before AdamW is built over the shards.

    Raises:
        ValueError: fsdp2 with LoRA, the distributed weight push, or algorithm parts that run
            their own forward through the model; top-k distillation without teacher top-k.
    """
    s = settings.trainer
    bf16, why = resolve_precision(s.precision, resolve_device(s.device))
    emulated = bf16 and not native_bf16(resolve_device(s.device))
    (log.warning if emulated else log.info)("trainer precision: %s", why)
    fsdp = world is not None and s.distributed_strategy == "fsdp2"
    if fsdp:
        check_fsdp_settings(settings)
    check_teacher_inputs(settings)
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    source_dir = resolve_model_path(s.model_path or settings.engine.model_path)
    store = CheckpointStore(Path(s.checkpoint_dir), s.keep_checkpoints, source_dir)
    latest = store.latest()
    model = load_model(latest.path if latest else source_dir, s.device)
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if s.lora_rank > 0:
        from flywheel.trainer.lora import add_lora  # noqa: PLC0415 (peft is optional)

        model = add_lora(model, s)
    reference = None
    if s.kl_coef > 0:
        ref_path = (
            resolve_model_path(s.reference_model_path) if s.reference_model_path else (source_dir)
        )
        reference = load_model(ref_path, s.device).requires_grad_(False).eval()
        log.info("KL reference policy (frozen) loaded from %s", ref_path)
    trained = None
    if fsdp:
        from flywheel.trainer.fsdp import shard_policy  # noqa: PLC0415

        trained = shard_policy(model)
        log.info("rank %d: model sharded with FSDP2 over %d ranks", world.rank, world.size)
    optimizer = build_optimizer(model, s)
    scheduler = build_scheduler(optimizer, s)
    if latest is not None:
        restore_training_state(optimizer, scheduler, latest, trained)
    return Policy(model, optimizer, scheduler, reference, latest, store, source_dir, trained)


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
        ValueError: LoRA, push_mode distributed, or an algorithm part with its own forward.
    """
    s = settings.trainer
    algo = StepConfig.from_settings(s).algo
    if s.lora_rank > 0:
        raise ValueError("distributed_strategy = 'fsdp2' with lora_rank > 0 is not supported")
    if s.push_mode == "distributed":
        raise ValueError("distributed_strategy = 'fsdp2' pushes from disk; set push_mode = 'disk'")
    if algo.needs_topk or algo.needs_entropy_pass:
        raise ValueError(
            "distributed_strategy = 'fsdp2' cannot run algorithm parts with their "
            "own forward (top-k regularizers, entropy-scored token weights)"
        )


def build_trainer(
    settings: FlywheelSettings,
    *,
    status: TrainerStatus | None = None,
    redis_client: redis.Redis | None = None,
    world: World | None = None,
) -> Trainer:
    """Load (or resume) the policy, connect to the source, and return a resumed `Trainer`.

    Args:
        settings: resolved settings (the trainer reads `trainer`, `streams`, `redis`, engines).
        status: the status the HTTP server shows (made here when None).
        redis_client: a client to use instead of connecting to `settings.redis_url()`.
        world: data-parallel ranks when run under torchrun (this is rank 0).
    """
    s = settings.trainer
    policy = build_policy(settings, world)
    latest, model = policy.latest, policy.model
    source, leases = build_source(settings, model.config.vocab_size, latest, redis_client)
    parts = TrainerParts(
        model=model,
        optimizer=policy.optimizer,
        reference=policy.reference,
        scheduler=policy.scheduler,
        consumer=source,
        pusher=build_pusher(settings, lambda: model),
        store=policy.store,
        leases=leases,
        sink=build_sink(s),
        status=status or TrainerStatus(),
        version=latest.step if latest else 0,
        world=world,
        trained=policy.trained,
    )
    if isinstance(source, FakeSource):
        source.version = lambda: parts.version
    if latest is not None:
        rng = load_training_state(latest.path, "rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
    log.info(
        "policy loaded from %s at weight version %d on %s; source %s",
        latest.path if latest else policy.source_dir,
        parts.version,
        model.device,
        source.kind,
    )
    trainer = Trainer(settings, parts)
    trainer.resume(latest)
    return trainer


def build_pusher(settings: FlywheelSettings, model: Any) -> Any:
    """The disk pusher, wrapped by the distributed one when `push_mode = "distributed"`."""
    s = settings.trainer
    disk = WeightPusher(
        settings.trainer_engine_urls(), timeout_s=s.push_timeout_s, attempts=s.push_attempts
    )
    if s.push_mode == "disk":
        return disk
    from flywheel.trainer.distributed_push import DistributedPusher  # noqa: PLC0415

    return DistributedPusher(
        disk,
        model,
        master_address=s.push_master_address,
        backend="nccl" if torch.cuda.is_available() and s.device != "cpu" else "gloo",
        timeout_s=s.push_timeout_s,
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
            return steps
        _, payloads, treatments = message
        groups = [[decode_sample(p) for p in group] for group in payloads]
        batch, _ = prepare_batch(groups, cfg, treatments)
        result = train_step(
            policy.trained or policy.model,
            policy.optimizer,
            batch,
            cfg,
            reference=policy.reference,
            scheduler=policy.scheduler,
            world=world,
        )
        if not result.skipped and policy.trained is not None:  # rank 0 saves a checkpoint
            from flywheel.trainer.fsdp import gather_checkpoint  # noqa: PLC0415

            gather_checkpoint(
                policy.model, policy.optimizer, policy.trained, settings.trainer.save_optimizer
            )
        steps += not result.skipped


def restore_training_state(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    latest: Checkpoint,
    trained: torch.nn.Module | None = None,
) -> None:
    """AdamW and scheduler state of `latest`, where it has them (logged when not). Under
    FSDP2 (`trained` is the root) the saved full AdamW state is sharded onto this rank."""
    optimizer_state = load_training_state(latest.path, "optimizer")
    if optimizer_state is not None and trained is not None:
        from flywheel.trainer.fsdp import load_full_optimizer_state  # noqa: PLC0415

        load_full_optimizer_state(trained, optimizer, optimizer_state)
    elif optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    else:
        log.warning("checkpoint %s has no optimizer state; AdamW starts fresh", latest.path)
    scheduler_state = load_training_state(latest.path, "scheduler")
    if scheduler_state is not None and scheduler is not None:
        scheduler.load_state_dict(scheduler_state)


class Trainer:
    """Runs the loop over `TrainerParts`; `run()` until stopped or `max_steps` steps."""

    def __init__(self, settings: FlywheelSettings, parts: TrainerParts):
        self.settings = settings
        self.s = settings.trainer
        self.parts = parts
        self.version = parts.version
        self.step_cfg = StepConfig.from_settings(self.s)
        self._stop = threading.Event()
        """Set by `run`'s caller to stop; also ends the retries of a failed Redis call."""
        self.assembler = GroupAssembler(
            self.s.group_size,
            self.s.group_wait_s,
            allow_truncated_sampling=self.s.allow_truncated_sampling,
            live_samples=self.s.live_advantage != "drop",
            partial_groups=self.s.partial_groups,
            min_group_size=self.s.min_group_size,
            keep_unjudged=self.s.unjudged == "keep",
            live_opd=self.s.live_advantage == "opd",
            vocab_size=parts.model.get_input_embeddings().num_embeddings,
        )
        self.staleness = StalenessPolicy(
            self.s.max_staleness, self.s.stale_policy, self.s.stale_decay, self.s.stale_hard_limit
        )
        self.behind: dict[str, str] = {}
        """Engines whose last push failed -> the error (pushed again at the next step)."""
        self.last_push_via = ""
        """`disk` or `distributed`: how the last successful push went."""
        self._drops: Tally[str] = Tally()
        self._last_step_end = time.monotonic()

    def resume(self, latest: Checkpoint | None) -> None:
        """Ack what the latest checkpoint trained on, push it to the engines, become ready."""
        if latest is not None:
            entry_ids = list(latest.state.get("entry_ids", []))
            acked = self.parts.consumer.ack(entry_ids)
            self.assembler.mark_trained(latest.state.get("sample_ids", []))
            log.info("resumed at step %d; acked %d entries it had trained on", latest.step, acked)
            self._push(latest.path)
        self.parts.status.set_ready(self.version)

    def run(self, stop: threading.Event | None = None, max_steps: int | None = None) -> int:
        """Loop until `stop` is set, `max_steps` optimizer steps (None = settings; 0 = no
        limit) are committed, or a finite source is used up; returns the steps committed."""
        limit = self.s.max_steps if max_steps is None else max_steps
        stop = self._stop = stop or threading.Event()
        start_version = self.version
        self.parts.leases.start()
        try:
            while not stop.is_set() and not (limit and self.version - start_version >= limit):
                if self.parts.consumer.exhausted and not self.assembler.pending:
                    log.info("source %s is used up", self.parts.consumer.kind)
                    break
                self._redis(self.poll, "reading the stream")
        finally:
            self.parts.leases.stop()
            if self.parts.world is not None:
                self.parts.world.broadcast(("stop",))
        return self.version - start_version

    def _redis(self, call: Any, what: str) -> Any:
        """`call()`, retried while Redis is out (redis_retry.py) until the loop stops."""
        return retry_redis(call, what, self._stop)

    def poll(self) -> None:
        """One iteration: train if enough groups are ready, else read more entries."""
        if self.parts.consumer.exhausted:
            for group in self.assembler.pending.values():  # nothing more will arrive
                group.first_seen_s = -float("inf")
        if self.assembler.should_step(self.s.groups_per_step, self.s.step_tokens):
            self.train_ready()
            return
        entries = self.parts.consumer.read(
            count=self.s.group_size * self.s.groups_per_step,
            block_ms=self.settings.streams.block_ms,
        )
        self.admit(entries)

    def admit(self, entries: Sequence[StreamEntry]) -> None:
        for entry in entries:
            drop = self.assembler.add(entry)
            if drop is None:
                self.parts.leases.hold([entry.entry_id])
            else:
                self.handle_drops([drop])

    def handle_drops(self, drops: Sequence[Drop]) -> None:
        """Ack or dead-letter each dropped entry; count and log it."""
        consumer = self.parts.consumer
        for drop in drops:
            entry = drop.entry
            if drop.reason.dead_letter:
                error = f"{drop.reason}: {drop.detail}"
                self._redis(
                    lambda e=entry, m=error: consumer.dead_letter(e.entry_id, e.payload, m),
                    f"dead-lettering entry {entry.entry_id}",
                )
            else:
                self._redis(
                    lambda e=entry: consumer.ack([e.entry_id]), f"acking entry {entry.entry_id}"
                )
            self.parts.leases.release([entry.entry_id])
            self.parts.status.record_drop(drop.reason)
            self._drops[drop.reason] += 1
            log.warning(
                "dropped sample %s (entry %s): %s %s",
                entry.sample.sample_id,
                entry.entry_id,
                drop.reason,
                drop.detail,
            )

    def train_ready(self) -> None:
        """Take the ready groups, run one step, and commit (or skip) it."""
        t0 = time.perf_counter()
        groups, drops, lags = self.assembler.pop_ready(
            self.s.groups_per_step, self.version, self.staleness, self.s.step_tokens
        )
        self.handle_drops(drops)
        for lag in lags:
            SAMPLE_LAG.observe(lag)
        if not groups:
            return
        wait_s = time.monotonic() - self._last_step_end
        treatments = [t for g in groups for t in g.treatments]
        if self.parts.world is not None:  # the other ranks train the same batch with us
            payloads = [[e.payload for e in g.entries] for g in groups]
            self.parts.world.broadcast(("step", payloads, treatments))
        batch, adv_metrics = prepare_batch([g.samples for g in groups], self.step_cfg, treatments)
        t1 = time.perf_counter()
        log.info("step %d: training on %d samples", self.version + 1, batch.size)
        result = train_step(
            self.parts.trained or self.parts.model,
            self.parts.optimizer,
            batch,
            self.step_cfg,
            reference=self.parts.reference,
            scheduler=self.parts.scheduler,
            world=self.parts.world,
        )
        metrics = (
            result.metrics
            | adv_metrics
            | _lag_metrics(lags)
            | {
                "time/wait_s": wait_s,
                "time/prepare_s": t1 - t0,
            }
        )
        if result.skipped:
            self._skip(groups, result.skipped, metrics)
        else:
            self._commit(groups, metrics)
        self._last_step_end = time.monotonic()

    def _training_state(self, optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.s.save_optimizer:
            return {}
        state: dict[str, Any] = {
            "optimizer": optimizer_state or self.parts.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        if self.parts.scheduler is not None:
            state["scheduler"] = self.parts.scheduler.state_dict()
        return state

    def _commit(self, groups: Sequence[Group], metrics: dict[str, Any]) -> None:
        entries = [e for g in groups for e in g.entries]
        entry_ids = [e.entry_id for e in entries]
        sample_ids = [e.sample.sample_id for e in entries]
        version = self.version + 1
        t0 = time.perf_counter()
        state = {
            "entry_ids": entry_ids,
            "sample_ids": sample_ids,
            "source_position": self._redis(
                self.parts.consumer.position, "reading the source position"
            ),
        }
        model_state, optimizer_state = None, None
        if self.parts.trained is not None:  # FSDP2: every rank gathers, rank 0 saves
            from flywheel.trainer.fsdp import gather_checkpoint  # noqa: PLC0415

            model_state, optimizer_state = gather_checkpoint(
                self.parts.model, self.parts.optimizer, self.parts.trained, self.s.save_optimizer
            )
        path = self.parts.store.save(
            self.parts.model,
            version,
            state,
            self._training_state(optimizer_state),
            state_dict=model_state,
        )
        t1 = time.perf_counter()
        self.version = version
        if version % self.s.push_every == 0 or self.behind:
            self._push(path)
        t2 = time.perf_counter()
        self._redis(lambda: self.parts.consumer.ack(entry_ids), f"acking step {version}")
        self.parts.leases.release(entry_ids)
        self.assembler.mark_trained(sample_ids)
        metrics |= {
            "checkpoint/mib": _folder_mib(path),
            "time/checkpoint_s": t1 - t0,
            "time/push_s": t2 - t1,
            "time/ack_s": time.perf_counter() - t2,
            "push/engines_behind": len(self.behind),
            "push/distributed": float(self.last_push_via == "distributed"),
        }
        # The metrics line is written before /status shows the step, so a reader that saw the
        # step there finds its line in the file.
        self._write_line(version, groups, metrics, skip_reason="")
        self.parts.status.record_step(version, len(entries), metrics)
        log.info(
            "step %d: %d samples, reward/mean %.4f, loss/pg %.5f, %.1f s",
            version,
            len(entries),
            metrics["reward/mean"],
            metrics.get("loss/pg", 0.0),
            metrics["time/step_s"],
        )

    def _skip(self, groups: Sequence[Group], reason: str, metrics: dict[str, Any]) -> None:
        """A skipped step trains nothing. Its samples are dropped: dead-lettered when they made
        the loss or gradient non-finite (kept for inspection), acked when they had no loss
        tokens. Weights, optimizer, scheduler and version stay as they were."""
        drop_reason = (
            DropReason.NO_LOSS_TOKENS if reason == "no_loss_tokens" else DropReason.NONFINITE_STEP
        )
        detail = f"{reason} at weight version {self.version}"
        self.handle_drops([Drop(e, drop_reason, detail) for g in groups for e in g.entries])
        self._write_line(self.version, groups, metrics, skip_reason=reason)
        self.parts.status.record_skip(reason, metrics)

    def _push(self, path: Path) -> None:
        """Push `path` to every engine; engines that fail are reported and kept as behind."""
        try:
            report = self.parts.pusher.push(path, self.version)
        except UpstreamError:
            failed = dict.fromkeys(self.parts.pusher.engine_urls, "failed")
            record_push(self.version, [], failed, 0.0)
            self.parts.status.set_engines_behind(failed)
            log.exception(
                "weight push of version %d failed on every engine; the checkpoint %s is kept and "
                "is pushed again when the trainer restarts",
                self.version,
                path,
            )
            raise
        record_push(self.version, report.ok, report.failed, report.seconds)
        self.last_push_via = report.via
        self.behind = dict(report.failed)
        self.parts.status.set_engines_behind(self.behind)
        for url, error in report.failed.items():
            log.error(
                "engine %s is behind: weight version %d failed (%s); it gets the newest "
                "checkpoint again at the next step",
                url,
                self.version,
                error,
            )

    def _write_line(
        self, version: int, groups: Sequence[Group], metrics: dict[str, Any], skip_reason: str
    ) -> None:
        record = {
            "step": version,
            "weight_version": str(version),
            "time": time.time(),
            "n_samples": sum(len(g.entries) for g in groups),
            "n_groups": len(groups),
            "skip_reason": skip_reason,
        }
        record |= {f"dropped/{reason}": n for reason, n in self._drops.items()}
        self._drops.clear()
        self.parts.sink.write(record | metrics)

    def close(self) -> None:
        self.parts.leases.stop()
        self.parts.pusher.close()
        self.parts.sink.close()


def _folder_mib(path: Path) -> float:
    """MiB of the files under `path` (a checkpoint: weights, tokenizer, training state)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _lag_metrics(lags: Sequence[int]) -> dict[str, float]:
    if not lags:
        return {}
    return {"staleness/lag_mean": sum(lags) / len(lags), "staleness/lag_max": float(max(lags))}
