"""Keeps stream entries the trainer holds from looking idle to XAUTOCLAIM.

The trainer keeps entries pending while it waits for their group (up to `group_wait_s`) and while
it trains, checkpoints and pushes. Past `min_idle_ms` idle, XAUTOCLAIM (run by every read,
including the trainer's own) would re-deliver them and bump their delivery count until they are
dead-lettered. A background thread re-claims the held entries for this consumer every
`min_idle_ms / 3` with XCLAIM JUSTID, which resets their idle time without counting a delivery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import redis

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Refreshes the idle time of held entries on a daemon thread.

    Args:
        client: redis-py client.
        stream, group, consumer: where the entries are pending.
        interval_s: seconds between refreshes.
    """

    def __init__(
        self, client: redis.Redis, stream: str, group: str, consumer: str, interval_s: float
    ):
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.interval_s = interval_s
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, entry_ids: Iterable[str]) -> None:
        with self._lock:
            self._held.update(entry_ids)

    def release(self, entry_ids: Iterable[str]) -> None:
        with self._lock:
            self._held.difference_update(entry_ids)

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def refresh(self) -> int:
        """Reset the idle time of every held entry; returns how many are still pending."""
        ids = self.held()
        if not ids:
            return 0
        claimed = self.client.xclaim(
            self.stream, self.group, self.consumer, min_idle_time=0, message_ids=[*ids], justid=True
        )
        return len(claimed)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="trainer-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except redis.RedisError as exc:  # bounded: the next refresh retries
                log.warning("could not refresh held stream entries: %s", exc)


class NullLeases:
    """The lease keeper of sources without idle reclaim (replay, fake): does nothing."""

    def hold(self, entry_ids: Iterable[str]) -> None:
        pass

    def release(self, entry_ids: Iterable[str]) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass
