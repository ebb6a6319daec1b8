"""Script deadlines on Redis's clock, tracked from this process's monotonic clock."""

from __future__ import annotations

from flywheel.gateway import script_deadline
from flywheel.gateway.script_deadline import ScriptDeadline


def test_deadline_is_redis_time_now_plus_half_the_reply_timeout(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(script_deadline.time, "monotonic", lambda: clock[0])
    deadline = ScriptDeadline(reply_timeout_s=5.0)
    assert deadline.deadline_ms() == 0 and not deadline.known  # Redis's time not seen yet
    deadline.observe(1_700_000_000_000)  # Redis said this at monotonic 100.0
    clock[0] = 102.0
    # Redis's time now: 1_700_000_000_000 + 2.0 s; plus half of the 5 s timeout: + 2.5 s
    assert deadline.deadline_ms() == 1_700_000_000_000 + 2_000 + 2_500
    assert ScriptDeadline(reply_timeout_s=None).deadline_ms() == 0  # no timeout: no deadline
