"""The trainer's metrics channels: Prometheus series, the per-step sinks, and the live status.

Prometheus (`/metrics`): counters, gauges and histograms named `flywheel_trainer_*` with their
unit in the name. Per step, `MetricsSink` writes the step's metrics under their slash-namespaced
keys to JSONL (`trainer.logging.metrics_path`, one line per optimizer step or skipped step), to
TensorBoard scalars (`<metrics_path folder>/tensorboard`, when `trainer.logging.tensorboard` and the
`tensorboard` package is installed) and to Weights & Biases (`trainer.logging.wandb_project`, when
`wandb` is installed). `TrainerStatus` is what `/status` shows; the training thread writes it
and the HTTP thread reads it, under a lock.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import threading
import time
from collections import Counter as Tally
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

STEPS = Counter("flywheel_trainer_steps_total", "Optimizer steps committed (checkpoint + push)")
STEPS_SKIPPED = Counter(
    "flywheel_trainer_steps_skipped_total", "Optimizer steps skipped", ["reason"]
)
SAMPLES_TRAINED = Counter("flywheel_trainer_samples_trained_total", "Samples in committed steps")
SAMPLES_DROPPED = Counter(
    "flywheel_trainer_samples_dropped_total", "Samples dropped before training", ["reason"]
)
PUSH_FAILURES = Counter(
    "flywheel_trainer_weight_push_failures_total",
    "Weight pushes to one engine that failed after every retry",
    ["engine"],
)
PUSH_SECONDS = Histogram(
    "flywheel_trainer_weight_push_seconds",
    "Seconds to push one checkpoint to every engine",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
ENGINE_VERSION = Gauge(
    "flywheel_trainer_engine_weight_version",
    "Weight version the trainer last pushed successfully to each engine",
    ["engine"],
)
ENGINES_BEHIND = Gauge("flywheel_trainer_engines_behind", "Engines whose last weight push failed")
TOKENS_PER_SECOND = Gauge(
    "flywheel_trainer_tokens_per_second", "Tokens (incl. prompt) per second of the last step"
)
TOKENS_TRAINED = Counter(
    "flywheel_trainer_tokens_trained_total", "Sampled (loss) tokens in committed steps"
)
CLIP_FRACTION = Gauge(
    "flywheel_trainer_clip_fraction_ratio", "Fraction of loss tokens clipped in the last step"
)
LOGPROB_GAP = Gauge(
    "flywheel_trainer_logprob_abs_diff_nats",
    "Mean |trainer - rollout| logprob of the last step's loss tokens",
)
PUSHES_COALESCED = Counter(
    "flywheel_trainer_pushes_coalesced_total",
    "Weight versions not pushed because newer weights arrived before their push started",
)
CHECKPOINT_SECONDS = Histogram(
    "flywheel_trainer_checkpoint_write_seconds",
    "Seconds to write one full checkpoint (in the background unless background_io is off)",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
REPLAYED_STEPS = Counter(
    "flywheel_trainer_replayed_steps_total",
    "Recorded steps trained again after a restart (from the commit log)",
)
REPLAY_MISSING = Counter(
    "flywheel_trainer_replay_missing_entries_total",
    "Entries of recorded steps that were no longer pending when the step was trained again",
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


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None:
        """One step's record: `step` plus slash-namespaced metrics."""

    def close(self) -> None: ...


class Timeline:
    """Stage events for the timeline picture: `timeline.jsonl` beside the metrics file, one
    line per event `{"process", "stage", "step", "start", "end"}` (wall-clock seconds).
    Stages: train (the step's forward/backward/update), checkpoint (writing a full
    checkpoint), push (writing the pushed weights and loading them into the engines)."""

    def __init__(self, path: Path, process: str = "trainer"):
        self.path = Path(path)
        self.process = process
        self._lock = threading.Lock()

    def event(self, stage: str, step: int, start: float, end: float) -> None:
        line = {"process": self.process, "stage": stage, "step": step, "start": start, "end": end}
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")


class JsonlSink:
    """Appends one JSON object per line to `path` (parent folders created), flushed per line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Every finite numeric metric of a record as a scalar at global step `record["step"]`."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (optional package)

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Logs each record to a Weights & Biases run (project `project`)."""

    def __init__(self, project: str, config: dict[str, Any]):
        import wandb  # noqa: PLC0415 (optional package)

        self.run = wandb.init(project=project, config=config)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


class MultiSink:
    """Writes each record to every sink."""

    def __init__(self, sinks: list[Any]):
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sink(s: Any) -> MultiSink:
    """JSONL always; TensorBoard and W&B when configured and their package is installed (a
    configured one that is missing is logged once, not fatal)."""
    sinks: list[Any] = [JsonlSink(Path(s.logging.metrics_path))]
    if s.logging.tensorboard:
        if importlib.util.find_spec("tensorboard") is None:
            log.warning(
                "trainer.logging.tensorboard is on but the tensorboard package is missing; "
                "install the trainer extra (pip install 'flywheel[trainer]')"
            )
        else:
            sinks.append(TensorBoardSink(Path(s.logging.metrics_path).parent / "tensorboard"))
    if s.logging.wandb_project:
        if importlib.util.find_spec("wandb") is None:
            log.warning("trainer.logging.wandb_project is set but wandb is not installed; skipped")
        else:
            sinks.append(WandbSink(s.logging.wandb_project, s.model_dump(mode="json")))
    return MultiSink(sinks)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in ("step", "time") or isinstance(value, bool | str):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            out[key] = float(value)
    return out


def record_push(version: int, ok: list[str], failed: dict[str, str], seconds: float) -> None:
    """Prometheus series of one push: per-engine versions and failures, push seconds."""
    for url in ok:
        ENGINE_VERSION.labels(url).set(version)
    for url in failed:
        PUSH_FAILURES.labels(url).inc()
    ENGINES_BEHIND.set(len(failed))
    if ok:
        PUSH_SECONDS.observe(seconds)


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
        self.engines_behind: dict[str, str] = {}
        self.started_at = time.time()

    def set_engines_behind(self, behind: dict[str, str]) -> None:
        with self._lock:
            self.engines_behind = dict(behind)

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
        TOKENS_PER_SECOND.set(metrics.get("tokens/per_s", 0.0))
        TOKENS_TRAINED.inc(metrics.get("tokens/trained", 0.0))
        CLIP_FRACTION.set(metrics.get("clip/frac", 0.0))
        LOGPROB_GAP.set(metrics.get("logprob/abs_diff_mean", 0.0))

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
                "engines_behind": dict(self.engines_behind),
                "uptime_s": time.time() - self.started_at,
            }


def report_push(outcome: Any, engine_urls: list[str], timeline: Timeline) -> dict[str, str] | None:
    """Count, log and draw one finished push (`background.PushOutcome`); returns the engines
    now behind (URL -> error; every engine when the push failed everywhere), or None for a
    version skipped because newer weights came first."""
    if outcome.coalesced:
        PUSHES_COALESCED.inc()
        log.info("weight version %d not pushed: newer weights came first", outcome.version)
        return None
    timeline.event("push", outcome.version, outcome.start, outcome.end)
    if outcome.error is not None:
        failed = dict.fromkeys(engine_urls, str(outcome.error))
        record_push(outcome.version, [], failed, 0.0)
        log.error(
            "weight push of version %d failed on every engine (%s); a restart pushes the "
            "weights again",
            outcome.version,
            outcome.error,
        )
        return failed
    report = outcome.report
    record_push(outcome.version, report.ok, report.failed, report.seconds)
    for url, error in report.failed.items():
        log.error(
            "engine %s is behind: weight version %d failed (%s); it gets the newest weights "
            "again at the next step",
            url,
            outcome.version,
            error,
        )
    return dict(report.failed)


def lag_metrics(lags: Sequence[int]) -> dict[str, float]:
    """Mean and max staleness (versions) of the samples a step examined; {} for none."""
    if not lags:
        return {}
    return {"staleness/lag_mean": sum(lags) / len(lags), "staleness/lag_max": float(max(lags))}
