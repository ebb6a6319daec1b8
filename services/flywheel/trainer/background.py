"""Checkpoint writes and weight pushes off the training step's critical path.

Both take snapshots made by the training thread between steps (snapshots.py: CPU tensors are
referenced until the next optimizer step would change them, and copied only then), so the next
step can update the live tensors while a background thread writes or pushes:

- `CheckpointWriter`: one checkpoint at a time. A checkpoint due while the previous one is still
  being written waits for it (the wait is returned and reported as `time/checkpoint_wait_s`).
  Finished checkpoints are handed back to the training thread by `finished()`, which acks the
  stream entries they cover there: an entry is acked only once its checkpoint is durable.
- `BackgroundPusher`: one push at a time, newest first. Weights offered while a push runs wait;
  weights still waiting when newer ones arrive are skipped (counted as `coalesced`), so an
  engine never gets an older version after a newer one. Each push writes the weights folder
  (`WeightsStore`) and then calls every engine at once (`WeightPusher.push`); with a
  `broadcast` (`trainer.push.mode = "distributed"`) it first broadcasts the snapshot over the
  weight-update group and writes and pushes the folder only when that cannot be done.

With `enabled = False` both run the work in the calling thread at once (the synchronous loop).
Errors raised in a background thread are handed back through `finished()` / `results()` and
raised or handled in the training thread, never lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flywheel.trainer.weights import PushReport

log = logging.getLogger(__name__)


@dataclass
class CheckpointJob:
    """A checkpoint to write: the snapshot of one committed step and what it covers."""

    step: int
    model: Any
    """The policy whose config `save_pretrained` writes (its tensors are not read)."""
    snapshot: Any
    """The step's weights and training state: a `snapshots.DeferredSnapshot` of
    {"weights": state dict, "training": AdamW, scheduler and RNG state}."""
    state: dict[str, Any]
    """trainer_state.json: entry ids and sample ids of every step since the last checkpoint."""
    entry_ids: list[str]
    """Stream entries to ack once the checkpoint is durable."""
    path: Path | None = None
    error: BaseException | None = None
    start: float = 0.0
    end: float = 0.0
    """Wall-clock seconds (time.time()) of the write."""
    sharded: Any = None
    """Under FSDP2 the future of every rank's sharded write (the checkpoint is durable when it
    is done too)."""


class CheckpointWriter:
    """Writes `CheckpointJob`s with `save(job) -> Path`, in a background thread when enabled."""

    def __init__(self, save: Callable[[CheckpointJob], Path], *, enabled: bool = True):
        self.save = save
        self.enabled = enabled
        self._lock = threading.Lock()
        self._done: list[CheckpointJob] = []
        self._thread: threading.Thread | None = None

    def submit(self, job: CheckpointJob) -> float:
        """Start writing `job`; returns the seconds spent waiting for the previous write."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        if not self.enabled:
            self._run(job)
            return waited
        self._thread = threading.Thread(
            target=self._run, args=(job,), name=f"checkpoint-{job.step}", daemon=True
        )
        self._thread.start()
        return waited

    def _run(self, job: CheckpointJob) -> None:
        job.start = time.time()
        try:
            job.path = self.save(job)
        except BaseException as exc:  # noqa: BLE001 (handed to the training thread)
            job.error = exc
        job.end = time.time()
        with self._lock:
            self._done.append(job)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the write in progress (if any) is finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finished(self) -> list[CheckpointJob]:
        """Jobs finished since the last call (successful or with `error` set), oldest first."""
        with self._lock:
            done, self._done = self._done, []
        return done


@dataclass
class PushOutcome:
    """One finished (or skipped) push."""

    version: int
    report: PushReport | None = None
    error: BaseException | None = None
    """Raised by the write or the push (e.g. UpstreamError: every engine failed)."""
    coalesced: bool = False
    """Skipped because newer weights arrived before it started."""
    path: Path | None = None
    start: float = 0.0
    end: float = 0.0
    """Wall-clock seconds (time.time()) of the write and the push."""
    write_s: float = 0.0
    bytes: int = 0
    """Size of the weights folder written (measured before a newer version can prune it)."""


@dataclass
class _Offer:
    version: int
    snapshot: Any = field(repr=False)


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a checkpoint or a pushed weights folder); 0 when it is
    gone."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def snapshot_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors of `state` (a tied alias counted once)."""
    seen = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in state.values()}
    return sum(seen.values())


class BackgroundPusher:
    """Writes and pushes offered weights one at a time, newest first (see module docstring).

    Args:
        write: (version, CPU snapshot) -> the weights folder (WeightsStore.write).
        push: (folder, version) -> PushReport (WeightPusher.push or DistributedPusher.push).
        enabled: run in a background thread; False = `offer` pushes at once.
        broadcast: (version, CPU snapshot) -> PushReport, or None when the disk path must take
            this push (DistributedPusher.broadcast); None = always the disk path.
    """

    def __init__(
        self,
        write: Callable[[int, Any], Path],
        push: Callable[[Path, int], PushReport],
        *,
        enabled: bool = True,
        broadcast: Callable[[int, dict[str, torch.Tensor]], PushReport | None] | None = None,
    ):
        self.write = write
        self.push = push
        self.broadcast = broadcast
        self.enabled = enabled
        self._cond = threading.Condition()
        self._waiting: _Offer | None = None
        self._running = False
        self._results: list[PushOutcome] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def offer(self, version: int, snapshot: Any) -> None:
        """Push `snapshot` (what `write` and `broadcast` take: a CPU snapshot dict or a
        `snapshots.DeferredSnapshot`) as `version` after the push in progress; replaces an
        offer that has not started (reported as coalesced)."""
        if not self.enabled:
            self._do(_Offer(version, snapshot))
            return
        with self._cond:
            if self._waiting is not None:
                self._results.append(PushOutcome(self._waiting.version, coalesced=True))
            self._waiting = _Offer(version, snapshot)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="push", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                offer, self._waiting = self._waiting, None
                self._running = True
            try:
                self._do(offer)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def _do(self, offer: _Offer) -> None:
        outcome = PushOutcome(offer.version, start=time.time())
        try:
            if self.broadcast is not None:
                outcome.report = self.broadcast(offer.version, offer.snapshot)
                outcome.bytes = snapshot_bytes(offer.snapshot) if outcome.report else 0
            if outcome.report is None:
                t0 = time.perf_counter()
                outcome.path = self.write(offer.version, offer.snapshot)
                outcome.write_s = time.perf_counter() - t0
                outcome.bytes = folder_bytes(outcome.path)
                outcome.report = self.push(outcome.path, offer.version)
        except BaseException as exc:  # noqa: BLE001 (handed to the training thread)
            outcome.error = exc
        outcome.end = time.time()
        with self._cond:
            self._results.append(outcome)

    @property
    def idle(self) -> bool:
        with self._cond:
            return self._waiting is None and not self._running

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is waiting or running; False when `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._waiting is not None or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def results(self) -> list[PushOutcome]:
        """Outcomes since the last call, in the order they finished."""
        with self._cond:
            done, self._results = self._results, []
        return done

    def close(self) -> None:
        """Finish what is waiting, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
