"""User-defined rewards the reward-service test loads as a plugin (`reward.plugins`): one that
reads the next state, one that raises, one that returns NaN and one out of its range."""

from __future__ import annotations

from flywheel.core.rewards import reward


@reward("thanked", inputs=("next_state", "turn"), range=(0, 1))
def thanked(next_state: str | None, turn: str) -> float:
    """0.75 when the next state thanks the turn, 0.25 otherwise (1.0 on an empty reply would be
    wrong: 0.0)."""
    if not turn:
        return 0.0
    return 0.75 if next_state and "thanks" in next_state else 0.25


@reward("raises", inputs=("turn",))
def raises(turn: str) -> float:
    """Always fails."""
    raise RuntimeError(f"cannot score {turn!r}")


@reward("nan", inputs=("task",))
def nan(task: dict) -> float:
    """Always NaN."""
    return float("nan")


@reward("too_big", inputs=("turn",), range=(0, 1))
def too_big(turn: str) -> float:
    """Always 2.0, outside (0, 1)."""
    return 2.0
