"""Prometheus metrics of the teacher service (one place, so names stay consistent).

Rates come from the counters: tokens scored per second = rate(flywheel_teacher_tokens_scored_total),
hint rate = rate(hints_total{outcome="hint"}) / rate(hints_total).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

SAMPLES = Counter("flywheel_teacher_samples_total", "Samples through the teacher stage", ["status"])
"""status: scored | no_hint | skipped | dead_lettered."""
TOKENS_SCORED = Counter(
    "flywheel_teacher_tokens_scored_total", "Student response tokens given a teacher logprob"
)
HINTS = Counter("flywheel_teacher_hints_total", "Hint extraction outcomes per turn", ["outcome"])
"""outcome: hint | no_hint | unjudged | no_next_state | task (environment-provided)."""
HINT_VOTES = Counter("flywheel_teacher_hint_votes_total", "Hint judge votes", ["outcome"])
"""outcome: hint | no_hint | parse | infra."""
LOGPROB_GAP = Histogram(
    "flywheel_teacher_logprob_gap",
    "Mean teacher - student logprob per scored Sample (nats)",
    buckets=(-8, -4, -2, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2, 4, 8),
)
BATCH_SIZE = Histogram(
    "flywheel_teacher_score_batch_size",
    "Scoring requests per /generate call",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
SCORE_SECONDS = Histogram("flywheel_teacher_score_seconds", "Seconds per teacher /generate call")
