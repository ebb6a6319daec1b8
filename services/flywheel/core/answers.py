"""Verifiable answer checks shared by the reward service (its `last_integer` verifier) and the
demo's held-out evaluation, so both score a reply the same way."""

from __future__ import annotations

import re
from typing import Any

from flywheel.core.errors import InvalidRequestError

_INT = re.compile(r"-?\d+")


def task_answer(task: dict[str, Any]) -> Any:
    """The task's `answer` field.

    Raises:
        InvalidRequestError: the task has no `answer`.
    """
    if "answer" not in task:
        raise InvalidRequestError("task metadata has no 'answer' for the verifier", param="task")
    return task["answer"]


def last_integer(response: str, task: dict[str, Any]) -> float:
    """1.0 when the last integer in `response` equals `task["answer"]`, else 0.0.

    "7 + 1 = 8" -> 8; "The answer is 8." -> 8; "1,024" -> 1024; "no digits" -> 0.0.

    Raises:
        InvalidRequestError: the task has no integer `answer`.
    """
    answer = task_answer(task)
    try:
        expected = int(answer)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"last_integer needs an integer 'answer', got {answer!r}", param="task"
        ) from exc
    found = _INT.findall(response.replace(",", ""))
    return 1.0 if found and int(found[-1]) == expected else 0.0
