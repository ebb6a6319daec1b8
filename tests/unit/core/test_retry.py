"""The shared retry wait: exponential backoff from `backoff_s`, capped at 30 x backoff_s, plus
jitter in [0, backoff_s]."""

from __future__ import annotations

import random

import pytest
import tenacity

from flywheel.core.retry import jittered_backoff


def _wait_after(failed_try: int, backoff_s: float) -> float:
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = failed_try
    return jittered_backoff(backoff_s)(state)


@pytest.mark.parametrize(
    ("failed_try", "base"),
    [
        (1, 0.5),  # 0.5 * 2**0
        (2, 1.0),  # 0.5 * 2**1
        (3, 2.0),  # 0.5 * 2**2
        (10, 15.0),  # 0.5 * 2**9 = 256, capped at 30 * 0.5 = 15
    ],
)
def test_the_wait_doubles_from_backoff_s_up_to_its_cap_plus_jitter(failed_try, base):
    random.seed(0)
    waits = [_wait_after(failed_try, 0.5) for _ in range(200)]
    assert all(base <= w <= base + 0.5 for w in waits)
    assert max(waits) - min(waits) > 0.25  # the jitter spreads the waits over [0, 0.5]
