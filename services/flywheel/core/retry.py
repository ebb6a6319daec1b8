"""The platform's wait between retries of an HTTP call: exponential backoff with jitter.

Shared by the judge clients (`judge_client.py`) and the teacher's engine calls, so every
service backs off the same way; each caller keeps its own stop rule and retry predicate.
"""

from __future__ import annotations

import tenacity


def jittered_backoff(backoff_s: float) -> tenacity.wait.wait_base:
    """tenacity wait before try n + 1 after try n (n = 1, 2, ...) failed, in seconds:
    min(backoff_s * 2 ** (n - 1), 30 * backoff_s) + uniform jitter in [0, backoff_s].

    Example, backoff_s = 0.5: after try 1, 0.5 + [0, 0.5] s; after try 3, 0.5 * 4 = 2.0 plus
    [0, 0.5] s; after try 10, 0.5 * 512 = 256 capped at 30 * 0.5 = 15, plus [0, 0.5] s.
    """
    return tenacity.wait_exponential(multiplier=backoff_s, max=30 * backoff_s) + (
        tenacity.wait_random(0, backoff_s)
    )
