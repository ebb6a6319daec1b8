"""Deadlines for the session scripts, on Redis's own clock, so a script that reaches Redis after
the gateway stopped waiting for it does nothing.

A Redis that stalls (paused, swapping, a long fork) keeps the commands it was sent; the gateway
gives up after its reply timeout and answers 503, and the client retries. Without a deadline the
stalled commands still run once Redis resumes: a lock script locks the session for a request
that is gone (the retry waits out the lease), a save records a turn whose client got an error
(its retry records it again). Each script carries a deadline on Redis's clock and, past it,
only releases the lock it may hold.

Redis's time is tracked from the `TIME` every lock script returns, advanced by this process's
monotonic clock: no agreement between the hosts' clocks is needed. A reply read late (this
process busy, e.g. a long tokenization holding the GIL) makes Redis's clock look behind, never
ahead, so the estimate keeps the largest offset seen, relaxed by 1 ms per second so that a
Redis whose clock was set back is followed within minutes. The deadline is the reply timeout
after the script is sent: a late script is one whose client has given up.
"""

from __future__ import annotations

import time

from flywheel.core.metrics import labeled_counter

LATE = labeled_counter(
    "flywheel_gateway_session_scripts_late_total",
    "Session lock/save scripts that reached Redis after their deadline (Redis stalled past the "
    "gateway's reply timeout) and were not applied",
    "script",
    ("lock", "save"),
)

RELAX_MS_PER_S = 1.0
"""How fast the estimate of Redis's clock may fall back (ms per second)."""

NOW_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
local function late(deadline)
  return deadline ~= '0' and now_ms() > tonumber(deadline)
end
"""
"""Lua: `now_ms()`, Redis's time in ms; `late(deadline)`, whether that is past `deadline` (ms
on Redis's clock, '0' = none)."""


class ScriptDeadline:
    """Redis's clock as seen from this process, and the deadline for a script sent now.

    Args:
        reply_timeout_s: the client's reply timeout (None: it waits forever, no deadline).
    """

    def __init__(self, reply_timeout_s: float | None):
        self.reply_timeout_s = reply_timeout_s
        self._offset_ms: float | None = None
        """Estimate of Redis's time minus this process's monotonic time (ms)."""
        self._offset_at = 0.0
        """Monotonic time (s) the estimate was last raised."""

    @property
    def known(self) -> bool:
        """Whether Redis's time has been observed (deadlines need it)."""
        return self._offset_ms is not None

    def observe(self, redis_ms: float) -> None:
        """Record Redis's time (ms) as returned by a script just now."""
        now = time.monotonic()
        seen = float(redis_ms) - now * 1000
        relaxed = (
            None
            if self._offset_ms is None
            else self._offset_ms - (now - self._offset_at) * RELAX_MS_PER_S
        )
        if relaxed is None or seen >= relaxed:
            self._offset_ms, self._offset_at = seen, now
        else:
            self._offset_ms, self._offset_at = relaxed, now

    def deadline_ms(self) -> int:
        """The deadline (ms on Redis's clock) for a script sent now; 0 = none."""
        if self.reply_timeout_s is None or self._offset_ms is None:
            return 0
        return int(self._offset_ms + (time.monotonic() + self.reply_timeout_s) * 1000)
