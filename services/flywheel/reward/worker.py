"""Stream stage: read `rollouts` in group `reward`, score, write the next stream, then ack.

Several entries are scored at once (`max_in_flight` asyncio tasks), each acked as soon as it is
done, so one slow judge never blocks the stream. The blocking Redis calls run in threads.

Delivery (at-least-once): the next stream is written before the ack, so a crash in between
re-delivers the entry and the next stage sees it twice; consumers are idempotent by `sample_id`.
- Entries left pending by a dead consumer are reclaimed by the consumer's XAUTOCLAIM after
  `min_idle_ms`; entries this worker is still scoring have their idle time refreshed (XCLAIM
  JUSTID every `min_idle_ms / 3`) so no replica steals them, and a reclaimed copy of an entry
  already in flight here is skipped.
- A failed attempt (a scorer exception, or the `sample_timeout_s` deadline) leaves the entry
  pending; it is retried when reclaimed. After `max_failures` failed attempts in this process, or
  more than `max_deliveries` deliveries across processes, it goes to the dead-letter stream with
  its error: never silently dropped. An unjudged Sample is not a failure: it is forwarded with
  `has_reward = false` and its reason.
- Judge down (BUG-22): after `breaker_samples` consecutive Samples unjudged for
  infrastructure reasons (timeouts, refused connections, 5xx), the worker takes no new entries
  for `breaker_pause_s` (doubling per failed probe, up to 8x), so the backlog waits in the stream
  rather than flowing on unjudged; then it scores one entry as a probe, and a judged probe closes
  the breaker. `flywheel_reward_breaker_open` is 1 meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import redis

from flywheel.core.errors import BackpressureError
from flywheel.core.streams import StreamConsumer, StreamEntry, StreamProducer
from flywheel.reward import metrics
from flywheel.reward.scoring import Scorer, is_unjudged

log = logging.getLogger(__name__)


class RewardWorker:
    """Consumes rollouts until `stop()`.

    Args:
        consumer: reader of the rollouts stream (group `reward`).
        producer: writer of the next stream (`scored`, or `train` when the teacher is off).
        scorer: the configured scorers.
        block_ms: milliseconds one read blocks waiting for new entries.
        max_in_flight: entries scored concurrently.
        sample_timeout_s: seconds one scoring attempt may take.
        max_failures: failed attempts of one entry before it is dead-lettered.
    """

    def __init__(
        self,
        consumer: StreamConsumer,
        producer: StreamProducer,
        scorer: Scorer,
        *,
        block_ms: int = 1000,
        max_in_flight: int = 16,
        sample_timeout_s: float = 600.0,
        max_failures: int = 3,
        breaker_samples: int = 5,
        breaker_pause_s: float = 10.0,
    ):
        self.consumer = consumer
        self.producer = producer
        self.scorer = scorer
        self.block_ms = block_ms
        self.max_in_flight = max_in_flight
        self.sample_timeout_s = sample_timeout_s
        self.max_failures = max_failures
        self.failures: Counter[str] = Counter()
        self.breaker_samples = breaker_samples
        self.breaker_pause_s = breaker_pause_s
        self.infra_streak = 0
        self.paused_until = 0.0
        self.pauses = 0
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._stop = asyncio.Event()
        self._lease_task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        """Ask `run` to finish (in-flight entries are completed first)."""
        self._stop.set()

    async def run(self) -> None:
        """Read, schedule and finish entries until stopped; then wait for the ones in flight."""
        while not self._stop.is_set():
            await self.step()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()))

    async def step(self) -> int:
        """One read (or one wait for a free slot); returns how many entries were scheduled."""
        if self._lease_task is None or self._lease_task.done():
            self._lease_task = asyncio.create_task(self._keep_leases())
        free = self.max_in_flight - len(self.tasks)
        if self.breaker_open:
            loop = asyncio.get_running_loop()
            if loop.time() < self.paused_until or self.tasks:  # paused, or a probe in flight
                wait = max(0.0, min(self.paused_until - loop.time(), self.block_ms / 1000))
                if self.tasks:
                    await asyncio.wait(list(self.tasks.values()), timeout=wait or 0.05)
                else:
                    await asyncio.sleep(wait)
                return 0
            free = 1  # one probe
        if free <= 0:
            await asyncio.wait(
                list(self.tasks.values()),
                timeout=self.block_ms / 1000,
                return_when=asyncio.FIRST_COMPLETED,
            )
            return 0
        block = self.block_ms if not self.tasks else min(self.block_ms, 50)
        try:
            if await self._downstream_full():
                return 0
            entries = await asyncio.to_thread(self.consumer.read, count=free, block_ms=block)
        except redis.RedisError as exc:  # bounded: the next step retries
            log.warning("reading %s failed: %s", self.consumer.stream, exc)
            await asyncio.sleep(self.block_ms / 1000)
            return 0
        scheduled = 0
        for entry in entries:
            if entry.entry_id in self.tasks:  # our own in-flight entry, reclaimed: skip
                continue
            task = asyncio.create_task(self._process(entry))
            self.tasks[entry.entry_id] = task

            def forget(_task: asyncio.Task[None], eid: str = entry.entry_id) -> None:
                self.tasks.pop(eid, None)

            task.add_done_callback(forget)
            scheduled += 1
        if not entries and self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=0.01)
        metrics.IN_FLIGHT.set(len(self.tasks))
        return scheduled

    async def _downstream_full(self) -> bool:
        """True (after waiting `block_ms`) while the next stream is at its high-water mark: no new
        entries are read, so they wait unread in `rollouts` (whose lag is the gateway's
        backpressure signal) instead of being scored, refused and redelivered into the dead
        letter."""
        high = getattr(self.producer, "high_water", 0)
        full = bool(high) and await asyncio.to_thread(self.producer.backlog) >= high
        if full != getattr(self, "_paused", False):
            self._paused = full
            log.warning(
                "%s %s its high-water mark (%d): %s new rollouts",
                self.producer.stream,
                "is at" if full else "is below",
                high,
                "not reading" if full else "reading",
            )
        if full:
            await asyncio.sleep(self.block_ms / 1000)
        return full

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for every in-flight entry (tests, shutdown)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=timeout_s)

    async def _process(self, entry: StreamEntry) -> None:
        sample = entry.sample
        try:
            await asyncio.wait_for(self.scorer.score(sample), self.sample_timeout_s)
        except Exception as exc:  # noqa: BLE001  (deliberate: a poison entry must not stop us)
            kind = "timeout" if isinstance(exc, TimeoutError) else "exception"
            detail = (
                f"scoring took over {self.sample_timeout_s:g} s"
                if kind == "timeout"
                else f"{type(exc).__name__}: {exc}"
            )
            await self._failed(entry, kind, detail)
            return
        try:
            await asyncio.to_thread(self._forward, sample, entry.entry_id)
        except (BackpressureError, redis.RedisError) as exc:  # left pending: retried later
            metrics.FAILURES.labels("publish").inc()
            log.warning(
                "sample %s scored but not forwarded (%s); it stays pending", sample.sample_id, exc
            )
            return
        self.failures.pop(entry.entry_id, None)
        self._track_judge(sample)
        if sample.has_reward:
            metrics.SAMPLES.labels("scored").inc()
        elif is_unjudged(sample):
            metrics.SAMPLES.labels("unjudged").inc()
            log.warning("sample %s unjudged: %s", sample.sample_id, sample.error)
        else:
            metrics.SAMPLES.labels("unscored").inc()
            log.warning("sample %s unscored: %s", sample.sample_id, sample.error)

    @property
    def breaker_open(self) -> bool:
        return bool(self.breaker_samples) and self.infra_streak >= self.breaker_samples

    def _track_judge(self, sample) -> None:
        if is_unjudged(sample) and "infra/" in sample.error:
            self.infra_streak += 1
            if self.breaker_open:
                self.pauses = min(self.pauses + 1, 4)
                pause = self.breaker_pause_s * 2 ** (self.pauses - 1)
                self.paused_until = asyncio.get_running_loop().time() + pause
                metrics.BREAKER_OPEN.set(1)
                log.error(
                    "judge down: %d samples in a row unjudged (%s); pausing new reads for %.0f s",
                    self.infra_streak,
                    sample.error,
                    pause,
                )
        elif sample.votes:  # a judgment happened and was not an infra failure
            if self.breaker_open:
                log.warning("judge back: closing the breaker")
            self.infra_streak = self.pauses = 0
            metrics.BREAKER_OPEN.set(0)

    def _forward(self, sample, entry_id: str) -> None:
        """Publish to the next stream, then ack (one thread hop; the order is the contract)."""
        self.producer.publish(sample)
        self.consumer.ack([entry_id])

    async def _failed(self, entry: StreamEntry, kind: str, detail: str) -> None:
        metrics.FAILURES.labels(kind).inc()
        self.failures[entry.entry_id] += 1
        n = self.failures[entry.entry_id]
        log.error(
            "scoring sample %s failed (%d of %d): %s",
            entry.sample.sample_id,
            n,
            self.max_failures,
            detail,
        )
        if n < self.max_failures:
            return
        try:
            await asyncio.to_thread(
                self.consumer.dead_letter,
                entry.entry_id,
                entry.payload,
                f"scoring failed {n} times: {detail}",
            )
        except redis.RedisError as exc:
            log.warning("dead-lettering %s failed: %s", entry.entry_id, exc)
            return
        self.failures.pop(entry.entry_id, None)
        metrics.SAMPLES.labels("dead_lettered").inc()

    async def _keep_leases(self) -> None:
        """Every min_idle_ms / 3, reset the idle time of the entries in flight here."""
        c = self.consumer
        while not self._stop.is_set():
            await asyncio.sleep(c.min_idle_ms / 3000)
            if not self.tasks:
                continue
            try:
                await asyncio.to_thread(
                    c.client.xclaim,
                    c.stream,
                    c.group,
                    c.consumer,
                    min_idle_time=0,
                    message_ids=list(self.tasks),
                    justid=True,
                )
            except redis.RedisError as exc:  # bounded: the next round retries
                log.warning("could not refresh in-flight entries: %s", exc)
