"""Stream stage: read `scored` in group `teacher`, add teacher logprobs, write `train`, then ack.

The entries of one read are processed concurrently (`concurrency` threads), so their scoring
requests reach the batcher together and share /generate calls. At-least-once, as in the reward
stage: the next stream is written before the ack, so a crash in between re-delivers the entry;
consumers are idempotent by `sample_id`.

Failures: an engine outage (`UpstreamError`) leaves the entry pending, so it is reclaimed and
retried after `min_idle_ms` and dead-lettered after `max_deliveries`; any other failure (rows
that do not align, a foreign vocabulary, a malformed Sample) is a poison sample and goes to the
dead-letter stream at once with its error. Each is a metric and a log line.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from flywheel.core.errors import UpstreamError
from flywheel.core.streams import StreamConsumer, StreamEntry, StreamProducer
from flywheel.teacher import metrics
from flywheel.teacher.pipeline import Teacher

log = logging.getLogger(__name__)


class TeacherWorker:
    """Consumes the teacher's input stream until `stop` is set.

    Args:
        consumer: reader of the `scored` stream (group `teacher`).
        producer: writer of the `train` stream.
        teacher: the pipeline.
        block_ms: milliseconds a read blocks waiting for entries.
        concurrency: Samples processed at once.
    """

    def __init__(
        self,
        consumer: StreamConsumer,
        producer: StreamProducer,
        teacher: Teacher,
        block_ms: int = 1000,
        concurrency: int = 8,
    ):
        self.consumer = consumer
        self.producer = producer
        self.teacher = teacher
        self.block_ms = block_ms
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="teacher")
        self.concurrency = concurrency
        self.stop = threading.Event()

    def run_once(self) -> int:
        """Process one read of entries; returns how many were forwarded (and acked)."""
        entries = self.consumer.read(count=self.concurrency, block_ms=self.block_ms)
        futures = [
            (entry, self.pool.submit(self.teacher.process, entry.sample)) for entry in entries
        ]
        done = []
        for entry, future in futures:
            try:
                sample = future.result()
            except UpstreamError as exc:
                log.error(
                    "sample %s: teacher engine unavailable, left pending for retry: %s",
                    entry.sample.sample_id,
                    exc,
                )
                metrics.SAMPLES.labels("retry").inc()
                continue
            except Exception as exc:  # poison sample: dead-letter it, keep consuming
                self._dead_letter(entry, exc)
                continue
            self.producer.publish(sample)
            done.append(entry.entry_id)
        self.consumer.ack(done)
        return len(done)

    def _dead_letter(self, entry: StreamEntry, exc: Exception) -> None:
        log.error(
            "sample %s: teacher failed: %s: %s", entry.sample.sample_id, type(exc).__name__, exc
        )
        self.consumer.dead_letter(
            entry.entry_id, entry.payload, f"teacher failed: {type(exc).__name__}: {exc}"
        )
        metrics.SAMPLES.labels("dead_lettered").inc()

    def run(self) -> None:
        while not self.stop.is_set():
            self.run_once()
