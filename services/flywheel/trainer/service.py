"""The trainer loop (docs/architecture.md#the-trainer-loop; delivery: docs/streams.md):

    read source -> admit into groups -> (enough ready) -> stale: drop / down-weight / IS-correct
    -> advantages -> optimizer step -> commit record -> (background) push weights to every
    engine -> (every checkpoint_every steps, background) full checkpoint -> ack -> metrics

A step is committed by a durable record (commits.py), not by a checkpoint; entries are acked
once the checkpoint covering them is durable, and a resumed trainer trains the recorded steps
after its newest checkpoint again (`replay`). Pushes and checkpoints run from CPU snapshots in
background threads (background.py; `background_io = false` runs them on the critical path);
an engine is never given an older version than it serves (weights.py). An engine that fails
every push attempt is counted, logged, shown as behind and given the newest weights at the next
step; if every engine fails the trainer stops. Dropped samples are acked or dead-lettered at
once (`groups.DropReason`), each counted and logged. Redis outages are waited out
(redis_retry.py): reads, acks and dead letters are retried until Redis answers again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter as Tally
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import redis
import torch
from transformers import PreTrainedModel

from flywheel.core.settings import FlywheelSettings
from flywheel.core.streams import StreamEntry
from flywheel.trainer.abandon import abandon_on_stop
from flywheel.trainer.background import (
    BackgroundPusher,
    CheckpointJob,
    CheckpointWriter,
    PushOutcome,
    folder_bytes,
)
from flywheel.trainer.commits import CommitLog, CommitRecord, GroupRecord, capture_rng
from flywheel.trainer.deltas import attach_deltas
from flywheel.trainer.distributed import World
from flywheel.trainer.fsdp import full_state_dict
from flywheel.trainer.groups import Drop, DropReason, Group, GroupAssembler
from flywheel.trainer.policy import TrainerParts, build_policy, build_pusher, training_state
from flywheel.trainer.redis_retry import retry_redis
from flywheel.trainer.replay import replay
from flywheel.trainer.snapshots import SnapshotGuard, cpu_snapshot, deferred_write, write_snapshot
from flywheel.trainer.sources import FakeSource, build_source
from flywheel.trainer.staleness import StalenessPolicy
from flywheel.trainer.step import StepConfig, prepare_batch, train_step
from flywheel.trainer.telemetry import (
    CHECKPOINT_SECONDS,
    SAMPLE_LAG,
    Timeline,
    TrainerStatus,
    build_sink,
    lag_metrics,
    report_push,
)
from flywheel.trainer.weights import Checkpoint, WeightsStore, load_training_state, servable_state

log = logging.getLogger(__name__)


def build_trainer(
    settings: FlywheelSettings,
    *,
    status: TrainerStatus | None = None,
    redis_client: redis.Redis | None = None,
    world: World | None = None,
    stop: threading.Event | None = None,
) -> Trainer:
    """Load (or resume) the policy, connect to the source, and return a resumed `Trainer`.

    Args:
        settings: resolved settings (the trainer reads `trainer`, `streams`, `redis`, engines).
        status: the status the HTTP server shows (made here when None).
        redis_client: a client to use instead of connecting to `settings.redis_url()`.
        world: data-parallel ranks when run under torchrun (this is rank 0).
        stop: the event `run` is given (SIGTERM sets it): set during the resume, it abandons
            the recorded step being trained again (abandon.py).
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
        pusher=build_pusher(settings),
        store=policy.store,
        leases=leases,
        sink=build_sink(s),
        status=status or TrainerStatus(),
        version=latest.step if latest else 0,
        world=world,
        trained=policy.trained,
        sharded=policy.sharded,
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
    trainer._stop = stop or trainer._stop
    try:
        trainer.resume(latest)
    except BaseException:  # a push or checkpoint thread left running aborts the interpreter's exit
        trainer.close()
        raise
    return trainer


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
            self.s.batch.group_size,
            self.s.batch.group_wait_s,
            allow_truncated_sampling=self.s.data.allow_truncated_sampling,
            live_samples=self.s.algorithm.live_advantage != "drop",
            partial_groups=self.s.batch.partial_groups,
            min_group_size=self.s.batch.min_group_size,
            keep_unjudged=self.s.data.unjudged == "keep",
            live_opd=self.s.algorithm.live_advantage in ("opd", "opd_plus_rl"),
            vocab_size=cast(int, parts.model.get_input_embeddings().num_embeddings),
        )
        self.staleness = StalenessPolicy(self.s.staleness)
        self.behind: dict[str, str] = {}
        """Engines whose last push failed -> the error (pushed again at the next step)."""
        self.last_push_via = ""
        """`disk` or `distributed`: how the last successful push went."""
        self._drops: Tally[str] = Tally()
        self._last_step_end = time.monotonic()
        root = Path(self.s.checkpoint.dir)
        self.commits = CommitLog(root)
        self.checkpointed = parts.version
        """Step of the newest durable checkpoint (0 = none: the initial model)."""
        self.uncovered: list[tuple[str, str]] = []
        """(entry id, sample id) of steps committed since the newest checkpoint job."""
        self.unacked: set[str] = set()
        """Entries trained and not yet acked (their checkpoint is not durable yet)."""
        self._replaying = False
        """True while a recorded step is trained again (its metrics line says `replayed`)."""
        self._io_metrics: dict[str, float] = {}
        """Background checkpoint/push results, reported with the next step's metrics."""
        self._gathered: dict[str, torch.Tensor] | None = None
        """FSDP2: the full model and AdamW state gathered at the last step."""
        background = self.s.background_io
        self.writer = CheckpointWriter(self._save_checkpoint, enabled=background)
        self.weights = WeightsStore(root, parts.store.source_dir)
        self.guard = SnapshotGuard(parts.optimizer)  # snapshots copied before a step only
        write = attach_deltas(settings, self.weights, parts.pusher)  # trainer.push.delta
        broadcast = getattr(parts.pusher, "broadcast", None)  # push.mode = "distributed"
        self.defer_push = write == self.weights.write and broadcast is None
        """Pushes written from deferred snapshots (not deltas, which keep theirs as a base)."""
        self.pusher = BackgroundPusher(
            deferred_write(write), parts.pusher.push, enabled=background, broadcast=broadcast
        )
        self.timeline = Timeline(Path(self.s.logging.metrics_path).parent / "timeline.jsonl")
        dtype = self.s.push.dtype if self.s.push.dtype != "auto" else settings.engine.dtype
        self.push_dtype = getattr(torch, dtype)

    # ---------------------------------------------------------------- resume

    def resume(self, latest: Checkpoint | None) -> None:
        """Ack what the newest checkpoint covers, train the recorded steps after it again,
        push the current weights to engines that serve an older version, become ready. Folders
        of steps above the resumed one, left from a lost lineage, are deleted first (folders.py)."""
        self.parts.store.drop_after(self.version)
        self.weights.drop_after(self.version)
        if latest is not None:
            entry_ids = list(latest.state.get("entry_ids", []))
            acked = self._redis(
                lambda: self.parts.consumer.ack(entry_ids), "acking the checkpoint's entries"
            )
            self.assembler.mark_trained(latest.state.get("sample_ids", []))
            log.info("resumed at step %d; acked %d entries it had trained on", latest.step, acked)
        records = self.commits.after(self.version)
        if records:
            replay(self, records)
        if (latest is not None or records) and not self._stop.is_set():
            self._offer_push()
            self.pusher.wait()
            self._settle()
        self.parts.status.set_ready(self.version)

    # ---------------------------------------------------------------- loop

    def run(self, stop: threading.Event | None = None, max_steps: int | None = None) -> int:
        """Loop until `stop` is set, `max_steps` optimizer steps (None = settings; 0 = no
        limit) are committed, or a finite source is used up; returns the steps committed.
        On the way out the steps not yet covered by a checkpoint get one, and the last push
        is finished."""
        limit = self.s.max_steps if max_steps is None else max_steps
        stop = self._stop = stop or threading.Event()
        start_version = self.version
        self.parts.leases.start()
        clean = False
        try:
            while not stop.is_set() and not (limit and self.version - start_version >= limit):
                if self.parts.consumer.exhausted and not self.assembler.pending:
                    log.info("source %s is used up", self.parts.consumer.kind)
                    break
                self._settle()
                self._redis(self.poll, "reading the stream")
            clean = True
        finally:
            try:
                self.finish(checkpoint=clean)
            finally:
                self.parts.leases.stop()
                if self.parts.world is not None:
                    self.parts.world.broadcast(("stop",))
        return self.version - start_version

    def finish(self, checkpoint: bool = True) -> None:
        """Checkpoint the steps not yet covered (when `checkpoint`), wait for the checkpoint
        and push in progress, and ack what they cover."""
        if checkpoint and self.uncovered:
            self._checkpoint()
        self.writer.wait()
        self.pusher.wait()
        self._settle(raise_errors=checkpoint)

    def _redis(self, call: Any, what: str) -> Any:
        """`call()`, retried while Redis is out (redis_retry.py) until the loop stops."""
        return retry_redis(call, what, self._stop)

    def poll(self) -> None:
        """One iteration: train if enough groups are ready, else read more entries."""
        if self.parts.consumer.exhausted:
            for group in self.assembler.pending.values():  # nothing more will arrive
                group.first_seen_s = -float("inf")
        if self.assembler.should_step(self.s.batch.groups_per_step, self.s.batch.step_tokens):
            self.train_ready()
            return
        entries = self.parts.consumer.read(
            count=self.s.batch.group_size * self.s.batch.groups_per_step,
            block_ms=self.settings.streams.block_ms,
        )
        self.admit(entries)
        idle_s = time.monotonic() - self._last_step_end
        if self.uncovered and idle_s > self.s.checkpoint.idle_s and not self.writer.busy:
            log.info("no step for %.0f s: checkpointing step %d", idle_s, self.version)
            self._checkpoint()

    def admit(self, entries: Sequence[StreamEntry]) -> None:
        for entry in entries:
            if entry.entry_id in self.unacked:
                continue  # trained, waiting for its checkpoint (read back from our own PEL)
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
            self.s.batch.groups_per_step, self.version, self.staleness, self.s.batch.step_tokens
        )
        self.handle_drops(drops)
        for lag in lags:
            SAMPLE_LAG.observe(lag)
        if groups:
            self._train(groups, lags, t0)

    def _train(self, groups: list[Group], lags: Sequence[int], t0: float) -> None:
        """One optimizer step on `groups`, then commit or skip it."""
        rng = capture_rng()
        wait_s = time.monotonic() - self._last_step_end
        treatments = [t for g in groups for t in g.treatments]
        if self.parts.world is not None:  # the other ranks train the same batch with us
            payloads = [[e.payload for e in g.entries] for g in groups]
            self.parts.world.broadcast(("step", payloads, treatments))
        batch, adv_metrics = prepare_batch([g.samples for g in groups], self.step_cfg, treatments)
        t1 = time.perf_counter()
        log.info("step %d: training on %d samples", self.version + 1, batch.size)
        train_start = time.time()
        optimizer, alone = self.parts.optimizer, self.parts.world is None
        with abandon_on_stop(self._stop, self.parts.model, optimizer, alone) as step:
            result = train_step(
                cast(PreTrainedModel, self.parts.trained or self.parts.model),
                optimizer,
                batch,
                self.step_cfg,
                reference=self.parts.reference,
                scheduler=self.parts.scheduler,
                world=self.parts.world,
            )
        if step.abandoned:  # stopped before optimizer.step(): its entries stay pending
            log.warning(
                "step %d abandoned at the stop (%d samples, gradients discarded): its entries "
                "stay pending and are trained after a restart",
                self.version + 1,
                batch.size,
            )
            return
        metrics = (
            result.metrics
            | adv_metrics
            | lag_metrics(lags)
            | {
                "time/wait_s": wait_s,
                "time/prepare_s": t1 - t0,
            }
        )
        if result.skipped:
            self._skip(groups, result.skipped, metrics)
        else:
            self.timeline.event("train", self.version + 1, train_start, time.time())
            self._commit(groups, metrics, rng)
        self._last_step_end = time.monotonic()

    # ---------------------------------------------------------------- commit

    def _commit(self, groups: Sequence[Group], metrics: dict[str, Any], rng: Any) -> None:
        entries = [e for g in groups for e in g.entries]
        entry_ids = [e.entry_id for e in entries]
        sample_ids = [e.sample.sample_id for e in entries]
        version = self.version + 1
        t0 = time.perf_counter()
        if self.parts.trained is not None:  # FSDP2: every rank gathers the weights to export
            self._gathered = full_state_dict(self.parts.model)
        record = CommitRecord(
            version,
            [
                GroupRecord(
                    g.group_id,
                    [e.entry_id for e in g.entries],
                    [(str(t), float(w)) for t, w in g.treatments],
                    list(g.version_floors),
                )
                for g in groups
            ],
            sample_ids,
            rng,
        )
        self.commits.append(record)  # the step is committed
        t1 = time.perf_counter()
        self.version = version
        self.uncovered += list(zip(entry_ids, sample_ids, strict=True))
        self.unacked.update(entry_ids)
        self.assembler.mark_trained(sample_ids)
        if version % self.s.push.every == 0 or self.behind:
            self._offer_push()
        t2 = time.perf_counter()
        checkpoint_wait = 0.0
        if version % self.s.checkpoint.every == 0:
            checkpoint_wait = self._checkpoint()
        t3 = time.perf_counter()
        self._settle()
        metrics |= {
            "time/commit_s": t1 - t0,
            "time/push_s": t2 - t1,
            "time/checkpoint_s": t3 - t2,
            "time/checkpoint_wait_s": checkpoint_wait,
            "time/ack_s": time.perf_counter() - t3,
            "push/engines_behind": len(self.behind),
            "push/distributed": float(self.last_push_via == "distributed"),
            "checkpoint/step": float(self.checkpointed),
            "checkpoint/unacked_entries": float(len(self.unacked)),
        } | self._io_metrics
        self._io_metrics = {}
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

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The servable weights: the FSDP2 gather, a LoRA merge, or the model's own."""
        if self._gathered is not None:
            return self._gathered
        base, merged = servable_state(self.parts.model)
        return merged if merged is not None else base.state_dict()

    def _offer_push(self) -> None:
        """Hand a snapshot of the current weights (engine dtype) to the background pusher."""
        take = self.guard.take if self.defer_push else cpu_snapshot
        self.pusher.offer(self.version, take(self._model_state(), self.push_dtype))

    def _checkpoint(self) -> float:
        """Snapshot the model, AdamW, scheduler and RNG at this version and write them as a
        checkpoint (background); returns the seconds spent waiting for the previous one."""
        base, _ = servable_state(self.parts.model)
        covered, self.uncovered = self.uncovered, []
        state = {
            "entry_ids": [e for e, _ in covered],
            "sample_ids": [s for _, s in covered],
            "source_position": self._redis(
                self.parts.consumer.position, "reading the source position"
            ),
        }
        job = CheckpointJob(
            step=self.version,
            model=base,
            snapshot=self.guard.take(
                {
                    "weights": self._model_state(),
                    "training": training_state(
                        self.parts.optimizer,
                        self.parts.scheduler,
                        self.s.checkpoint.save_optimizer,
                        sharded=self.parts.sharded is not None,
                    ),
                }
            ),
            state=state,
            entry_ids=state["entry_ids"],
        )
        if self.parts.sharded is not None:  # FSDP2: every rank writes its own shards
            cast(World, self.parts.world).broadcast(("checkpoint", self.version))
            job.sharded = self.parts.sharded.save(self.version, self.s.checkpoint.save_optimizer)
        return self.writer.submit(job)

    def _save_checkpoint(self, job: CheckpointJob) -> Path:
        path = write_snapshot(
            job.snapshot,
            lambda tree, intact: self.parts.store.save(
                job.model, job.step, job.state, tree["training"], tree["weights"], intact
            ),
        )
        if job.sharded is not None:  # durable once every rank's shards are written too
            job.sharded.result()
            self.parts.sharded.prune(set(self.parts.store.steps()))
        return path

    def _settle(self, raise_errors: bool = True) -> None:
        """Handle finished background work: ack the entries of durable checkpoints, record
        pushes. A failed checkpoint, or a push that failed on every engine, is raised."""
        for job in self.writer.finished():
            if job.error is not None:
                log.error("checkpoint of step %d failed: %s", job.step, job.error)
                if raise_errors:
                    raise job.error
                continue
            assert job.path is not None
            self._redis(
                lambda ids=job.entry_ids: self.parts.consumer.ack(ids),
                f"acking the entries of checkpoint {job.step}",
            )
            self.parts.leases.release(job.entry_ids)
            self.unacked.difference_update(job.entry_ids)
            self.checkpointed = max(self.checkpointed, job.step)
            self.commits.truncate(job.step)
            CHECKPOINT_SECONDS.observe(job.end - job.start)
            self.timeline.event("checkpoint", job.step, job.start, job.end)
            self._io_metrics |= {  # the newest durable one since the last line
                "checkpoint_version": job.step,
                "checkpoint_seconds": job.end - job.start,
                "checkpoint_bytes": folder_bytes(job.path),
            }
            log.info(
                "checkpoint of step %d durable in %.1f s; acked %d entries",
                job.step,
                job.end - job.start,
                len(job.entry_ids),
            )
        for outcome in self.pusher.results():
            self._record_push(outcome, raise_errors)

    def _record_push(self, outcome: PushOutcome, raise_errors: bool) -> None:
        behind = report_push(outcome, self.parts.pusher.engine_urls, self.timeline)
        if behind is None:  # coalesced: nothing was pushed
            return
        self.behind = behind
        self.parts.status.set_engines_behind(behind)
        if outcome.error is not None:
            if raise_errors:
                raise outcome.error
            return
        assert outcome.report is not None
        self.last_push_via = outcome.report.via
        self._io_metrics |= {  # the newest push that ended since the last line
            "push_version": outcome.version,
            "push_seconds": outcome.end - outcome.start,
            "push_bytes": outcome.bytes,
            "push/write_s": outcome.write_s,
            "push/load_s": outcome.report.seconds,
        }

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
            "replayed": self._replaying,
        }
        record |= {f"dropped/{reason}": n for reason, n in self._drops.items()}
        self._drops.clear()
        self.parts.sink.write(record | metrics)

    def close(self) -> None:
        self.parts.leases.stop()
        self.writer.wait()
        self.pusher.close()
        self.parts.pusher.close()
        self.parts.sink.close()
