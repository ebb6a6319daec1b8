"""Weight pushes to the engine fleet: every engine at once with a per-engine deadline, and a
watcher that gives an engine joining mid-run the current weights.

- `push_each`: one thread per engine; an engine that has not finished within
  `fleet.push_deadline_s` is counted in `flywheel_trainer_push_timeouts_total{engine}`, logged
  and reported as failed (behind), never fatal by itself; the others' results stand.
- `FleetWatcher`: every `fleet.refresh_s` it reads the shared fleet (core/fleet.py), logs
  engines that joined or left, and pushes the newest pushed weights to every member serving an
  older version (an engine that joined, or one restarted with its initial weights). Gateways
  route to a joined engine only once it serves the fleet's version (gateway/engines/
  fleet_watch.py), so its first request already runs on the current weights. Under
  `trainer.push.mode = "distributed"` the newest weights are the last broadcast's snapshot,
  written once as a folder when a member is behind it (`weights`, distributed_push.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import redis
from prometheus_client import Counter

from flywheel.core.fleet import Fleet, static_urls

if TYPE_CHECKING:
    from flywheel.core.settings import FlywheelSettings
    from flywheel.trainer.weights import WeightPusher

log = logging.getLogger(__name__)
PUSH_TIMEOUTS = Counter(
    "flywheel_trainer_push_timeouts_total",
    "Engine weight pushes past fleet.push_deadline_s",
    ["engine"],
)
JOIN_PUSHES = Counter(
    "flywheel_trainer_join_pushes_total",
    "Pushes of the current weights to an engine that served an older version, by outcome",
    ["outcome"],
)

Outcome = tuple[str | None, tuple[float, float]]
"""(None = took it | "skipped" | the error, wall-clock (start, end) in time.time() seconds)."""


def push_each(
    urls: list[str], push_one: Callable[[str], str | None], deadline_s: float
) -> dict[str, Outcome]:
    """`push_one(url)` for every engine at once, each bounded by `deadline_s` (0 = none).

    Returns:
        URL -> (outcome of `push_one`, or the deadline error; its wall-clock span). An engine
        past the deadline keeps its thread until its own call times out; it is reported now.

    Raises:
        whatever `push_one` raises besides its reported errors.
    """
    if not urls:
        log.warning("no engine to push to: the fleet is empty (flywheel engines list)")
        return {}
    starts: dict[str, float] = {}

    def timed(url: str) -> Outcome:
        starts[url] = time.time()
        outcome = push_one(url)
        return outcome, (starts[url], time.time())

    pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="push")
    futures = {pool.submit(timed, url): url for url in urls}
    t0 = time.time()
    done, _ = wait(futures, timeout=deadline_s or None)
    pool.shutdown(wait=False)
    out: dict[str, Outcome] = {}
    for future, url in futures.items():
        if future in done:
            out[url] = future.result()
            continue
        PUSH_TIMEOUTS.labels(url).inc()
        error = f"no answer within fleet.push_deadline_s = {deadline_s} s"
        log.error("weight push to engine %s timed out: %s; the others go on", url, error)
        out[url] = (error, (starts.get(url, t0), time.time()))
    return out


class NewestWeights(Protocol):
    """Where the newest pushed weights are when they are not the disk pusher's folder (the
    distributed pusher's kept broadcast snapshot)."""

    def latest_version(self) -> int | None: ...

    def latest_folder(self) -> tuple[Path, int] | None: ...


def shared_fleet(settings: FlywheelSettings, redis_client: Any = None) -> Fleet | None:
    """The shared fleet the trainer pushes to, or None for a fixed list: None when
    `trainer.push.engine_urls` is set (the workers behind an SGLang router, say), or when the
    trainer has no Redis (a fake or replay source without `redis.url`)."""
    if settings.trainer.push.engine_urls:
        return None
    uses_redis = (
        settings.trainer.data.source == "redis"
        or bool(settings.redis.url)
        or redis_client is not None
        or settings.fleet.discovery != "static"
    )
    if not uses_redis:
        return None
    from flywheel.core.redis_client import connect  # noqa: PLC0415

    client = redis_client or connect(settings.redis_url())
    fleet = Fleet(client, settings.streams.prefix, static_urls(settings), settings.fleet)
    fleet.seed()
    return fleet


class FleetWatcher:
    """Pushes the newest weights to fleet members that serve an older version (see module
    docstring); a daemon thread, `close()` stops it.

    Args:
        pusher: the disk pusher (its `latest` weights, per-engine locks and deadline).
        fleet: the shared fleet.
        interval_s: seconds between passes (`fleet.refresh_s`).
    """

    def __init__(self, pusher: WeightPusher, fleet: Fleet, interval_s: float):
        self.pusher = pusher
        self.fleet = fleet
        self.interval_s = interval_s
        self.known: set[str] = set()
        self.weights: NewestWeights | None = None
        """Set by the distributed pusher; None = the disk pusher's newest folder (`latest`)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FleetWatcher:
        """Set the fleet's version to the newest one its engines serve (a new run starts from
        what is served, not from an older run's label), then watch in the background."""
        served = [self.pusher.served_version(u) for u in self.fleet.refresh()]
        self.fleet.set_version(max([v for v in served if v is not None], default=0))
        self._thread = threading.Thread(target=self._loop, name="fleet-watch", daemon=True)
        self._thread.start()
        return self

    def check(self) -> dict[str, str | None]:
        """One pass; returns URL -> outcome for every engine pushed to (None = took it).

        Raises:
            redis.RedisError: Redis did not answer.
        """
        urls = self.fleet.refresh()
        for url in sorted(set(urls) - self.known):
            log.info("engine %s is in the fleet", url)
        for url in sorted(self.known - set(urls)):
            log.info("engine %s left the fleet", url)
        self.known = set(urls)
        latest = self.pusher.latest
        version = latest[1] if latest else None
        if self.weights is not None:
            version = self.weights.latest_version()
        if version is None:  # nothing pushed yet: every engine serves the initial weights
            return {}
        behind = []
        for url in urls:
            if self.pusher.busy(url):
                continue  # a push to it is running; it is checked again next pass
            served = self.pusher.served_version(url)
            if served is not None and served < version:
                behind.append(url)
        if not behind:
            return {}
        if self.weights is not None:  # the broadcast snapshot, written once as a folder
            latest = self.weights.latest_folder()
        if latest is None:
            return {}
        path, version = latest
        log.info("engines %s serve a version older than %d; pushing it", behind, version)
        results = push_each(
            behind,
            lambda url: self.pusher.push_with_retries(url, path, version),
            self.pusher.engine_deadline_s,
        )
        outcomes = {url: outcome for url, (outcome, _) in results.items()}
        for url, outcome in outcomes.items():
            JOIN_PUSHES.labels("ok" if outcome in (None, "skipped") else "failed").inc()
            if outcome not in (None, "skipped"):
                log.warning("engine %s did not take version %d: %s", url, version, outcome)
        return outcomes

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except (redis.RedisError, OSError) as exc:
                log.warning("fleet watch pass failed (%s); trying again", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 30)
            self._thread = None
