"""One way to build a redis-py client for services (bytes responses, bounded retries)."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry


def connect(url: str) -> redis.Redis:
    """A client for `url` that retries connection errors 3 times with jittered backoff."""
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        socket_connect_timeout=5,
    )
