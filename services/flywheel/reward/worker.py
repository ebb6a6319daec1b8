"""Stream stage: read `rollouts` in group `reward`, score, write the next stream, then ack.

At-least-once: the next stream is written before the ack, so a crash in between re-delivers the
entry and the next stage sees it twice; consumers are idempotent by `sample_id`.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import Counter

from flywheel.core.streams import StreamConsumer, StreamProducer
from flywheel.reward.judge import NextStateJudge
from flywheel.reward.scoring import score_sample

log = logging.getLogger(__name__)
SCORED = Counter("flywheel_reward_samples_total", "Samples scored", ["outcome"])


class RewardWorker:
    """Consumes rollouts until `stop` is set.

    Args:
        consumer: reader of the rollouts stream (group `reward`).
        producer: writer of the next stream (`scored`, or `train` when the teacher is off).
        default_verifier: verifier for tasks that name none.
        judge: next-state judge; None = disabled.
        weights: reward component -> weight; missing = 1.0.
    """

    def __init__(self, consumer: StreamConsumer, producer: StreamProducer,
                 default_verifier: str, block_ms: int = 1000,
                 judge: NextStateJudge | None = None, weights: dict[str, float] | None = None):
        self.judge = judge
        self.weights = weights
        self.consumer = consumer
        self.producer = producer
        self.default_verifier = default_verifier
        self.block_ms = block_ms
        self.stop = threading.Event()

    def run_once(self, count: int = 32) -> int:
        """Process one batch of entries; returns how many were forwarded."""
        entries = self.consumer.read(count=count, block_ms=self.block_ms)
        done = []
        for entry in entries:
            try:
                sample = score_sample(entry.sample, self.default_verifier, self.weights,
                                      self.judge)
            except Exception as exc:  # poison entry: dead-letter it, keep consuming
                log.exception("scoring sample %s failed", entry.sample.sample_id)
                self.consumer.dead_letter(entry.entry_id, entry.payload,
                                          f"scoring failed: {type(exc).__name__}: {exc}")
                SCORED.labels("dead_lettered").inc()
                continue
            if sample.has_reward:
                SCORED.labels("scored").inc()
            else:
                SCORED.labels("unscored").inc()
                log.warning("sample %s unscored: %s", sample.sample_id, sample.error)
            self.producer.publish(sample)
            done.append(entry.entry_id)
        self.consumer.ack(done)
        return len(done)

    def run(self) -> None:
        while not self.stop.is_set():
            self.run_once()
