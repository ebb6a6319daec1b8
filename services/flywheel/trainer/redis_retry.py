"""The trainer's rule for Redis outages: retry the call with backoff until Redis answers again
(or the loop is stopped), each failure counted and logged."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import redis
from prometheus_client import Counter

log = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_ERRORS = Counter(
    "flywheel_trainer_redis_errors_total",
    "Trainer calls to Redis that failed and were retried (outage)",
)
REDIS_BACKOFF_S = (0.5, 10.0)
"""First and longest pause between retries of a failed Redis call (seconds)."""


def retry_redis(call: Callable[[], T], what: str, stop: threading.Event) -> T:
    """`call()`, retried with backoff (0.5 s doubling to 10 s) while it fails with a Redis
    error, until it succeeds.

    Args:
        what: what the call does, for the log line ("reading the stream").
        stop: set to give up: the last error is then raised.

    Raises:
        redis.RedisError: the call failed and `stop` is set.
    """
    pause = REDIS_BACKOFF_S[0]
    while True:
        try:
            return call()
        except redis.RedisError as exc:
            REDIS_ERRORS.inc()
            if stop.is_set():
                raise
            log.warning("Redis call failed while %s: %s; retrying in %.1f s", what, exc, pause)
            stop.wait(pause)
            pause = min(pause * 2, REDIS_BACKOFF_S[1])
