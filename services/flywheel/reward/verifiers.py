"""Verifiable rewards: pure functions `(response_text, task) -> float` in [0, 1].

Registry `VERIFIERS` is keyed by the name a task's metadata gives in `verifier`.
To add one: write the function, add one registry line, add a worked-example test.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from flywheel.core.errors import InvalidRequestError

_INT = re.compile(r"-?\d+")


def last_integer(response: str, task: dict[str, Any]) -> float:
    """1.0 when the last integer in `response` equals `task["answer"]`, else 0.0.

    "7 + 1 = 8" -> 8; "The answer is 8." -> 8; "no digits" -> 0.0.

    Raises:
        InvalidRequestError: the task has no integer `answer`.
    """
    answer = _answer(task)
    found = _INT.findall(response.replace(",", ""))
    return 1.0 if found and int(found[-1]) == int(answer) else 0.0


def exact(response: str, task: dict[str, Any]) -> float:
    """1.0 when the stripped response equals the stripped `task["answer"]` exactly."""
    return 1.0 if response.strip() == str(_answer(task)).strip() else 0.0


def _answer(task: dict[str, Any]) -> Any:
    if "answer" not in task:
        raise InvalidRequestError("task metadata has no 'answer' for the verifier", param="task")
    return task["answer"]


VERIFIERS: dict[str, Callable[[str, dict[str, Any]], float]] = {
    "last_integer": last_integer,
    "exact": exact,
}
