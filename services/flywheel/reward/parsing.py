"""Strict parsing of judge replies and aggregation of votes (BUG-20, BUG-22).

A judge reply counts only through its last non-empty line, which must read
`<label>: <value>` (label "Final verdict" for a verdict set, "Final score" for a range); Markdown
emphasis around the line or the number and one trailing period are tolerated. Anything else is an
invalid vote with a reason, never a 0:

- "no_verdict": empty reply, or the last line is not the declared form (a verdict followed by
  more text, a score only inside the reasoning, "Reward: 7" instead of the label);
- "invalid_value": the value is outside the declared set or range (never clipped).

Because only the final line counts, a verdict quoted or planted inside the judged response (which
the prompt places before the judge's own reasoning) cannot become the parsed verdict unless the
judge itself ends its reply with it.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from flywheel.core.judge_client import Parsed

NO_VERDICT = "no_verdict"
INVALID_VALUE = "invalid_value"
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"


def _final_value(reply: str, label: str) -> tuple[str | None, str]:
    lines = [ln.strip() for ln in reply.strip().splitlines() if ln.strip()]
    if not lines:
        return None, "empty reply"
    line = lines[-1].strip("*_`# ").strip()
    pattern = rf"{label}\s*:\s*[*_`]*\s*({_NUMBER})\s*[*_`]*\s*\.?"
    match = re.fullmatch(pattern, line, flags=re.IGNORECASE)
    if match is None:
        return None, f"last line is not '{label}: <value>': {lines[-1][:80]!r}"
    return match.group(1), ""


def parse_verdict(
    reply: str, allowed: tuple[int, ...] = (-1, 0, 1), label: str = "Final verdict"
) -> Parsed:
    """A verdict from a declared integer set.

    "...\\nFinal verdict: +1" -> 1; "**Final verdict: -1**" -> -1; "Final verdict: 1.0" -> 1;
    "Final verdict: 10" -> invalid_value; "Final verdict: 0.5" -> invalid_value;
    "Reward: 1" or a verdict followed by more text -> no_verdict.
    """
    text, why = _final_value(reply, label)
    if text is None:
        return Parsed(None, NO_VERDICT, why)
    value = float(text)
    if not math.isfinite(value) or value != int(value) or int(value) not in allowed:
        return Parsed(None, INVALID_VALUE, f"verdict {text} not in {list(allowed)}")
    return Parsed(float(int(value)), "ok")


def parse_score(reply: str, low: float, high: float, label: str = "Final score") -> Parsed:
    """A score in the declared closed range [low, high] (BUG-20 table).

    Scale 0-10: "Final score: 10" -> 10; "Final score: 12" -> invalid_value (not clipped);
    scale 0-1: "Final score: 1e-1" -> 0.1, "Final score: **0.8**" -> 0.8, "Final score: 0.75."
    -> 0.75; scale -1-1: "Final score: -0.5" -> -0.5; "I cannot grade this." -> no_verdict.
    """
    text, why = _final_value(reply, label)
    if text is None:
        return Parsed(None, NO_VERDICT, why)
    value = float(text)
    if not (math.isfinite(value) and low <= value <= high):
        return Parsed(None, INVALID_VALUE, f"score {text} outside [{low:g}, {high:g}]")
    return Parsed(value, "ok")


def majority(values: list[float]) -> float | None:
    """Majority of valid votes from a verdict set; tie -> mean of the tied values; [] -> None.

    [1, 1, -1] -> 1.0; [1, -1] -> (1 - 1) / 2 = 0.0; [1, 0] -> (1 + 0) / 2 = 0.5;
    [0, 1, -1] -> (0 + 1 - 1) / 3 = 0.0; [] -> None (unjudged, never 0).
    """
    if not values:
        return None
    counts = Counter(values).most_common()
    top = [v for v, n in counts if n == counts[0][1]]
    return sum(top) / len(top)


def mean(values: list[float]) -> float | None:
    """Mean of valid range scores; [] -> None. [7, 9] -> 8.0 (BUG-20: n_valid = 2 of 3)."""
    return sum(values) / len(values) if values else None


def agreement(values: list[float]) -> float | None:
    """Share of valid votes equal to the most common value; [1, 1, -1] -> 2/3; [] -> None."""
    if not values:
        return None
    return Counter(values).most_common(1)[0][1] / len(values)
