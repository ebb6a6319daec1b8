"""Prometheus metrics of one engine (own registry, so several engines can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "flywheel_engine_requests",
            "Finished /generate rows by finish type.",
            ["finish"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "flywheel_engine_prompt_tokens", "Prompt tokens prefilled.", registry=r
        )
        self.generated_tokens = Counter(
            "flywheel_engine_generated_tokens", "Tokens sampled.", registry=r
        )
        self.batch_size = Histogram(
            "flywheel_engine_batch_size",
            "Rows in the running batch per decode step.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "flywheel_engine_batch_seconds", "Wall time of one decode step, seconds.", registry=r
        )
        self.queue_depth = Gauge(
            "flywheel_engine_queue_depth", "Rows waiting for the next batch.", registry=r
        )
        self.queue_rejected = Counter(
            "flywheel_engine_queue_rejected",
            "Rows refused because the queue was full (engine.max_queued_requests).",
            registry=r,
        )
        self.weight_updates = Counter(
            "flywheel_engine_weight_updates", "Weight updates by outcome.", ["outcome"], registry=r
        )
        self.weight_deltas = Counter(
            "flywheel_engine_weight_deltas",
            "Weight deltas by outcome: applied, base_mismatch, checksum_mismatch, invalid.",
            ["outcome"],
            registry=r,
        )
        self.weight_version = Info(
            "flywheel_engine_weight", "Weight version currently served.", registry=r
        )

    def set_weight_version(self, version: str) -> None:
        self.weight_version.info({"version": version})

    def render(self) -> bytes:
        return generate_latest(self.registry)
