"""Prometheus metrics of the reward service (served on `reward.metrics_port` at /metrics).

Label `judge` is the judge's name in the settings ("judge", "step", "rubric"); `reason` is a
failure kind of flywheel.core.judge_client / parsing (timeout, connection, server_error,
client_error, bad_response, no_verdict, invalid_value). Rates ("judged per second") are
`rate(flywheel_reward_judged_total[1m])` in Prometheus.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from flywheel.core.judge_client import judge_metrics

JUDGE_CALLS = judge_metrics("reward")
"""flywheel_reward_judge_{up,call_seconds,retries_total} (flywheel.core.judge_client)."""

JUDGED = Counter(
    "flywheel_reward_judged_total", "Judgments with at least one valid vote", ["judge"]
)
UNJUDGED = Counter(
    "flywheel_reward_unjudged_total",
    "Judgments with no valid vote, by the most common failure",
    ["judge", "reason"],
)
VOTES = Counter(
    "flywheel_reward_judge_votes_total",
    "Judge votes by outcome (valid or the failure kind)",
    ["judge", "outcome"],
)
AGREEMENT = Histogram(
    "flywheel_reward_vote_agreement_ratio",
    "Share of a judgment's valid votes equal to its most common vote",
    ["judge"],
    buckets=(0.34, 0.5, 0.67, 0.75, 0.99, 1.0),
)
COMPONENT = Histogram(
    "flywheel_reward_component_value",
    "Reward value per scorer component (verifier, judge, step, rubric, outcome)",
    ["component"],
    buckets=(-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10),
)
SAMPLES = Counter(
    "flywheel_reward_samples_total",
    "Samples by outcome: scored, unscored, unjudged, dead_lettered",
    ["outcome"],
)
SCORE_SECONDS = Histogram(
    "flywheel_reward_sample_score_seconds",
    "Wall time to score one Sample (all components), seconds",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge("flywheel_reward_in_flight_samples", "Samples being scored by the worker now")
FAILURES = Counter(
    "flywheel_reward_scoring_failures_total",
    "Scoring attempts that failed (exception or deadline), by kind",
    ["kind"],
)
BREAKER_OPEN = Gauge(
    "flywheel_reward_breaker_open",
    "1 while the stream worker pauses new reads because the judge is down",
)
PLUGIN_UNSCORED = Counter(
    "flywheel_reward_plugin_unscored_total",
    "Samples left unscored by a user-defined reward (flywheel.core.rewards), by the reward's name "
    "and the reason: exception, not_a_number, not_finite (NaN or inf), out_of_range",
    ["reward", "reason"],
)
