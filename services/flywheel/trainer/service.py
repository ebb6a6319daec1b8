"""The trainer loop (DESIGN.md section 8):

    read train stream -> admit into groups -> (enough ready groups) -> drop stale -> advantages
    -> optimizer step -> checkpoint -> push weights to every engine -> ack -> JSONL metrics line

Delivery: an entry is acked only after the step that used it is checkpointed and pushed. The
checkpoint records the entry ids it trained on, so a trainer that crashes between checkpoint
and ack acks them when it resumes (and pushes that checkpoint again) instead of training them
twice. Dropped samples are acked or dead-lettered at once (see `groups.DropReason`), each counted
and logged.
"""

from __future__ import annotations

import logging
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

from flywheel.core.errors import UpstreamError
from flywheel.core.paths import resolve_model_path
from flywheel.core.redis_client import connect
from flywheel.core.settings import FlywheelSettings
from flywheel.core.streams import StreamConsumer, StreamEntry, default_consumer_name
from flywheel.trainer.groups import Drop, DropReason, Group, GroupAssembler
from flywheel.trainer.leases import LeaseKeeper
from flywheel.trainer.staleness import StalenessPolicy
from flywheel.trainer.step import (
    StepConfig,
    build_optimizer,
    build_scheduler,
    prepare_batch,
    train_step,
)
from flywheel.trainer.telemetry import PUSH_FAILURES, SAMPLE_LAG, JsonlSink, TrainerStatus
from flywheel.trainer.weights import Checkpoint, CheckpointStore, WeightPusher, load_model

log = logging.getLogger(__name__)

CONSUMER_GROUP = "trainer"


@dataclass
class TrainerParts:
    """Everything the loop uses, built by `build_trainer` (tests build their own)."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    consumer: StreamConsumer
    pusher: WeightPusher
    store: CheckpointStore
    leases: LeaseKeeper
    sink: JsonlSink
    status: TrainerStatus
    version: int
    """Committed optimizer steps of the loaded weights (0 = the initial model)."""
    reference: PreTrainedModel | None = None
    """Frozen reference policy for the KL term (None when kl_coef is 0)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def build_trainer(
    settings: FlywheelSettings,
    *,
    status: TrainerStatus | None = None,
    redis_client: redis.Redis | None = None,
) -> Trainer:
    """Load (or resume) the policy, connect to the stream, and return a resumed `Trainer`.

    Args:
        settings: resolved settings (the trainer reads `trainer`, `streams`, `redis`, engines).
        status: the status the HTTP server shows (made here when None).
        redis_client: a client to use instead of connecting to `settings.redis_url()`.
    """
    s = settings.trainer
    torch.manual_seed(s.seed)
    source = resolve_model_path(s.model_path or settings.engine.model_path)
    store = CheckpointStore(Path(s.checkpoint_dir), s.keep_checkpoints, source)
    latest = store.latest()
    model = load_model(latest.path if latest else source, s.device)
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    client = redis_client or connect(settings.redis_url())
    consumer_name = s.consumer_name or default_consumer_name()
    stream = settings.streams.key("train")
    consumer = StreamConsumer(
        client, stream, CONSUMER_GROUP, consumer_name,
        dead_stream=settings.streams.key("dead"),
        max_deliveries=settings.streams.max_deliveries,
        min_idle_ms=settings.streams.min_idle_ms,
    )
    interval_s = max(settings.streams.min_idle_ms / 3000, 0.5)
    reference = None
    if s.kl_coef > 0:
        ref_path = resolve_model_path(s.reference_model_path) if s.reference_model_path else source
        reference = load_model(ref_path, s.device).requires_grad_(False).eval()
        log.info("KL reference policy (frozen) loaded from %s", ref_path)
    optimizer = build_optimizer(model, s)
    parts = TrainerParts(
        model=model,
        optimizer=optimizer,
        reference=reference,
        scheduler=build_scheduler(optimizer, s),
        consumer=consumer,
        pusher=WeightPusher(
            settings.trainer_engine_urls(), timeout_s=s.push_timeout_s, attempts=s.push_attempts
        ),
        store=store,
        leases=LeaseKeeper(client, stream, CONSUMER_GROUP, consumer_name, interval_s),
        sink=JsonlSink(Path(s.metrics_path)),
        status=status or TrainerStatus(),
        version=latest.step if latest else 0,
    )
    log.info("policy loaded from %s at weight version %d on %s",
             latest.path if latest else source, parts.version, model.device)
    trainer = Trainer(settings, parts)
    trainer.resume(latest)
    return trainer


class Trainer:
    """Runs the loop over `TrainerParts`; `run()` until stopped or `max_steps` steps."""

    def __init__(self, settings: FlywheelSettings, parts: TrainerParts):
        self.settings = settings
        self.s = settings.trainer
        self.parts = parts
        self.version = parts.version
        self.step_cfg = StepConfig.from_settings(self.s)
        self.assembler = GroupAssembler(
            self.s.group_size, self.s.group_wait_s,
            allow_truncated_sampling=self.s.allow_truncated_sampling,
            live_samples=self.s.live_advantage != "drop",
            partial_groups=self.s.partial_groups,
            min_group_size=self.s.min_group_size,
        )
        self.staleness = StalenessPolicy(
            self.s.max_staleness, self.s.stale_policy, self.s.stale_decay, self.s.stale_hard_limit
        )
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
        """Loop until `stop` is set or `max_steps` optimizer steps (None = settings; 0 = no
        limit) are committed; returns the steps committed."""
        limit = self.s.max_steps if max_steps is None else max_steps
        stop = stop or threading.Event()
        start_version = self.version
        self.parts.leases.start()
        try:
            while not stop.is_set() and not (limit and self.version - start_version >= limit):
                self.poll()
        finally:
            self.parts.leases.stop()
        return self.version - start_version

    def poll(self) -> None:
        """One iteration: train if enough groups are ready, else read more entries."""
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
                consumer.dead_letter(entry.entry_id, entry.payload, f"{drop.reason}: {drop.detail}")
            else:
                consumer.ack([entry.entry_id])
            self.parts.leases.release([entry.entry_id])
            self.parts.status.record_drop(drop.reason)
            self._drops[drop.reason] += 1
            log.warning(
                "dropped sample %s (entry %s): %s %s",
                entry.sample.sample_id, entry.entry_id, drop.reason, drop.detail,
            )

    def train_ready(self) -> None:
        """Take the ready groups, run one step, and commit (or skip) it."""
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
        batch, adv_metrics = prepare_batch([g.samples for g in groups], self.step_cfg, treatments)
        result = train_step(
            self.parts.model, self.parts.optimizer, batch, self.step_cfg,
            reference=self.parts.reference, scheduler=self.parts.scheduler,
        )
        metrics = result.metrics | adv_metrics | _lag_metrics(lags) | {"time/wait_s": wait_s}
        if result.skipped:
            self._skip(groups, result.skipped, metrics)
        else:
            self._commit(groups, metrics)
        self._last_step_end = time.monotonic()

    def _commit(self, groups: Sequence[Group], metrics: dict[str, Any]) -> None:
        entries = [e for g in groups for e in g.entries]
        entry_ids = [e.entry_id for e in entries]
        sample_ids = [e.sample.sample_id for e in entries]
        version = self.version + 1
        t0 = time.perf_counter()
        path = self.parts.store.save(
            self.parts.model, version, {"entry_ids": entry_ids, "sample_ids": sample_ids}
        )
        t1 = time.perf_counter()
        self.version = version
        self._push(path)
        self.parts.consumer.ack(entry_ids)
        self.parts.leases.release(entry_ids)
        self.assembler.mark_trained(sample_ids)
        metrics |= {"time/checkpoint_s": t1 - t0, "time/push_s": time.perf_counter() - t1}
        self.parts.status.record_step(version, len(entries), metrics)
        self._write_line(version, groups, metrics, skip_reason="")
        log.info(
            "step %d: %d samples, reward/mean %.4f, loss/pg %.5f, %.1f s",
            version, len(entries), metrics["reward/mean"], metrics.get("loss/pg", 0.0),
            metrics["time/step_s"],
        )

    def _skip(self, groups: Sequence[Group], reason: str, metrics: dict[str, Any]) -> None:
        """A skipped step trains nothing. Its samples are dropped: dead-lettered when they made
        the loss or gradient non-finite (kept for inspection), acked when they had no loss
        tokens. Weights and version stay as they were."""
        drop_reason = (
            DropReason.NO_LOSS_TOKENS if reason == "no_loss_tokens" else DropReason.NONFINITE_STEP
        )
        detail = f"{reason} at weight version {self.version}"
        self.handle_drops([Drop(e, drop_reason, detail) for g in groups for e in g.entries])
        self.parts.status.record_skip(reason, metrics)
        self._write_line(self.version, groups, metrics, skip_reason=reason)

    def _push(self, path: Path) -> None:
        try:
            self.parts.pusher.push(path, self.version)
        except UpstreamError:
            PUSH_FAILURES.inc()
            log.exception(
                "weight push of version %d failed after retries; the checkpoint %s is kept and "
                "is pushed again when the trainer restarts", self.version, path,
            )
            raise

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


def _lag_metrics(lags: Sequence[int]) -> dict[str, float]:
    if not lags:
        return {}
    return {"staleness/lag_mean": sum(lags) / len(lags), "staleness/lag_max": float(max(lags))}
