"""The trainer's metrics channels: Prometheus series, the JSONL step log, and the live status.

Prometheus (`/metrics`): counters and gauges named `flywheel_trainer_*`. JSONL
(`trainer.metrics_path`): one line per optimizer step (or skipped step) with the step's metrics
under their slash-namespaced keys. `TrainerStatus` is what `/status` shows; the training thread
writes it and the HTTP thread reads it, under a lock.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter as Tally
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("flywheel_trainer_steps_total", "Optimizer steps committed (checkpoint + push)")
STEPS_SKIPPED = Counter(
    "flywheel_trainer_steps_skipped_total", "Optimizer steps skipped", ["reason"]
)
SAMPLES_TRAINED = Counter("flywheel_trainer_samples_trained_total", "Samples in committed steps")
SAMPLES_DROPPED = Counter(
    "flywheel_trainer_samples_dropped_total", "Samples dropped before training", ["reason"]
)
PUSH_FAILURES = Counter(
    "flywheel_trainer_weight_push_failures_total", "Weight pushes that failed after retries"
)
WEIGHT_VERSION = Gauge("flywheel_trainer_weight_version", "Committed weight version (steps)")
REWARD_MEAN = Gauge("flywheel_trainer_reward_mean", "Mean reward of the last step's samples")
STEP_SECONDS = Histogram(
    "flywheel_trainer_step_seconds",
    "Seconds of one optimizer step (forward, backward, optimizer)",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
SAMPLE_LAG = Histogram(
    "flywheel_trainer_sample_lag_versions",
    "Weight versions between a sample's oldest sampled token and the trainer",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)


class JsonlSink:
    """Appends one JSON object per line to `path` (parent folders created), flushed per line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


class TrainerStatus:
    """Live trainer state shared between the training loop and the HTTP thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ready = False
        self.step = 0
        self.samples_trained = 0
        self.steps_skipped = 0
        self.samples_dropped: Tally[str] = Tally()
        self.last_metrics: dict[str, Any] = {}
        self.started_at = time.time()

    def set_ready(self, step: int) -> None:
        with self._lock:
            self.step = step
            self.ready = True
        WEIGHT_VERSION.set(step)

    def record_drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.samples_dropped[reason] += n
        SAMPLES_DROPPED.labels(reason).inc(n)

    def record_step(self, step: int, n_samples: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            self.step = step
            self.samples_trained += n_samples
            self.last_metrics = dict(metrics)
        STEPS.inc()
        SAMPLES_TRAINED.inc(n_samples)
        WEIGHT_VERSION.set(step)
        REWARD_MEAN.set(metrics.get("reward/mean", 0.0))
        STEP_SECONDS.observe(metrics.get("time/step_s", 0.0))

    def record_skip(self, reason: str, metrics: dict[str, Any]) -> None:
        with self._lock:
            self.steps_skipped += 1
            self.last_metrics = dict(metrics)
        STEPS_SKIPPED.labels(reason).inc()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "ready": self.ready,
                "step": self.step,
                "weight_version": str(self.step),
                "samples_trained": self.samples_trained,
                "samples_dropped": dict(self.samples_dropped),
                "steps_skipped": self.steps_skipped,
                "last_metrics": dict(self.last_metrics),
                "uptime_s": time.time() - self.started_at,
            }
