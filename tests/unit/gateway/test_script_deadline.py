"""Script deadlines on Redis's clock, tracked from this process's monotonic clock."""

from __future__ import annotations

from flywheel.gateway.session import script_deadline
from flywheel.gateway.session.script_deadline import ScriptDeadline

T0 = 1_700_000_000_000  # Redis's time (ms) at the first observation


def test_deadline_is_redis_time_now_plus_the_reply_timeout(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(script_deadline.time, "monotonic", lambda: clock[0])
    deadline = ScriptDeadline(reply_timeout_s=5.0)
    assert deadline.deadline_ms() == 0 and not deadline.known  # Redis's time not seen yet
    deadline.observe(T0)  # Redis said T0 at monotonic 100.0
    clock[0] = 102.0
    # Redis's time now: T0 + 2.0 s; plus the 5 s reply timeout
    assert deadline.deadline_ms() == T0 + 2_000 + 5_000
    assert ScriptDeadline(reply_timeout_s=None).deadline_ms() == 0  # no timeout: no deadline


def test_a_reply_read_late_does_not_pull_the_estimate_back(monkeypatch):
    """The process was busy for 4 s (a long tokenization holding the GIL) before it read a
    reply Redis sent at T0 + 1 s: that observation says Redis is 3 s behind; it is not, so the
    estimate keeps the earlier one (less the 1 ms/s relaxation)."""
    clock = [100.0]
    monkeypatch.setattr(script_deadline.time, "monotonic", lambda: clock[0])
    deadline = ScriptDeadline(reply_timeout_s=5.0)
    deadline.observe(T0)
    clock[0] = 105.0  # Redis's time is really T0 + 5 s; the reply it sent at T0 + 1 s is read now
    deadline.observe(T0 + 1_000)
    # estimate: T0 + 5 s - 5 s x 1 ms/s relaxation = T0 + 4,995 ms; + 5 s timeout
    assert deadline.deadline_ms() == T0 + 4_995 + 5_000
    deadline.observe(T0 + 5_000)  # a prompt reply: the estimate is exact again
    assert deadline.deadline_ms() == T0 + 5_000 + 5_000
