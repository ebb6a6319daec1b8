"""Running one user-defined reward (flywheel.core.rewards) on one Sample.

The declared inputs are built from the Sample, the function runs off the event loop, and its
value is checked against the declared range. Any failure is returned as a reason (never raised,
never 0), counted in `flywheel_reward_plugin_unscored_total{reward, reason}` and logged; the
Scorer then leaves the Sample unscored.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

from flywheel._proto import sample_pb2
from flywheel.core.rewards import RewardSpec
from flywheel.reward import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PluginResult:
    """A plugin's value, or why there is none.

    Attributes:
        value: the checked value (None when unscored).
        reason: "" when scored; else exception | not_a_number | not_finite | out_of_range.
        detail: the message for the Sample's `error` ("" when scored).
    """

    value: float | None
    reason: str = ""
    detail: str = ""


def plugin_inputs(
    spec: RewardSpec, sample: sample_pb2.Sample, task: dict[str, Any], turn: str
) -> dict[str, Any]:
    """Keyword arguments of `spec.fn` for this Sample (see flywheel.core.rewards for each input).

    Args:
        turn: the text of the last assistant message ("" if none).
    """
    from flywheel.reward.scoring import message_text  # noqa: PLC0415  (scoring imports us)

    values: dict[str, Any] = {}
    for name in spec.inputs:
        if name == "turn":
            values[name] = turn
        elif name == "task":
            values[name] = task
        elif name == "next_state":
            has = sample.HasField("next_state")
            values[name] = message_text(sample.next_state) if has else None
        elif name == "messages":
            values[name] = [{"role": m.role, "content": message_text(m)} for m in sample.messages]
    return values


def check_value(spec: RewardSpec, value: object) -> PluginResult:
    """`value` as a PluginResult: a finite real number within [spec.low, spec.high], else the
    reason it is not. Example: range (0, 1): 0.5 -> 0.5; 1.5 -> out_of_range; NaN ->
    not_finite; "1" -> not_a_number."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return PluginResult(
            None, "not_a_number", f"returned {type(value).__name__} {value!r}, not a number"
        )
    number = float(value)
    if not math.isfinite(number):
        return PluginResult(None, "not_finite", f"returned {number}, not a finite number")
    if not spec.low <= number <= spec.high:
        return PluginResult(
            None,
            "out_of_range",
            f"returned {number:g}, outside its declared range [{spec.low:g}, {spec.high:g}]",
        )
    return PluginResult(number)


async def run_plugin(
    spec: RewardSpec, sample: sample_pb2.Sample, task: dict[str, Any], turn: str
) -> PluginResult:
    """Call `spec.fn` on the Sample in a worker thread and check its value.

    Failures (an exception, a non-number, NaN/inf, out of range) are returned with their reason,
    counted in `PLUGIN_UNSCORED` and logged with the Sample id; nothing is raised.
    """
    try:
        raw = await asyncio.to_thread(spec.fn, **plugin_inputs(spec, sample, task, turn))
        result = check_value(spec, raw)
    except Exception as exc:  # noqa: BLE001  (a user's reward must not crash the service)
        result = PluginResult(None, "exception", f"raised {type(exc).__name__}: {exc}")
    if result.value is None:
        metrics.PLUGIN_UNSCORED.labels(spec.name, result.reason).inc()
        log.warning(
            "reward %r (%s) left sample %s unscored: %s: %s",
            spec.name,
            spec.module,
            sample.sample_id,
            result.reason,
            result.detail,
        )
    return result
