"""Verifiable rewards: pure functions `(response_text, task) -> float` in [0, 1].

Registry `VERIFIERS` is keyed by the name a task's metadata gives in `verifier`; `REQUIRED_KEY`
names the task field a verifier needs (default "answer"): a task without it is not verified.
To add one: write the function, add one registry line, add a worked-example test.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from flywheel.core.answers import last_integer, task_answer
from flywheel.core.errors import InvalidRequestError
from flywheel.reward.sandbox import code_tests

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_JSON_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)


def exact(response: str, task: dict[str, Any]) -> float:
    """1.0 when the stripped response equals the stripped `task["answer"]` exactly."""
    return 1.0 if response.strip() == str(task_answer(task)).strip() else 0.0


def math_answer(response: str, task: dict[str, Any]) -> float:
    """1.0 when `math-verify` finds the response's answer equal to `task["answer"]`.

    The answer may be LaTeX or plain ("\\frac{1}{2}", "0.5", "x^2+1"); the response's answer is
    extracted by math-verify (a \\boxed{...} wins, else the last expression). Off the main
    thread math-verify's signal-based timeouts cannot run, so they are disabled there.
    """
    from math_verify import parse, verify  # noqa: PLC0415  (sympy import is slow)

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    answer = str(task_answer(task))
    gold = parse(
        answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=timeout
    )
    if not gold:
        raise InvalidRequestError(f"math-verify cannot parse the answer {answer!r}", param="task")
    pred = parse(response, parsing_timeout=timeout)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0


def numeric(response: str, task: dict[str, Any]) -> float:
    """1.0 when the last number in `response` is within tolerance of `task["answer"]`.

    Tolerance: `math.isclose` with `task["rel_tol"]` (default 1e-6) and `task["abs_tol"]`
    (default 1e-9). Thousands separators are removed: "1,234.5" -> 1234.5; "no number" -> 0.0.
    """
    try:
        answer = float(task_answer(task))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"numeric verifier: answer is not a number: {exc}", param="task"
        ) from exc
    found = _NUMBER.findall(response.replace(",", ""))
    if not found:
        return 0.0
    return (
        1.0
        if math.isclose(
            float(found[-1]),
            answer,
            rel_tol=float(task.get("rel_tol", 1e-6)),
            abs_tol=float(task.get("abs_tol", 1e-9)),
        )
        else 0.0
    )


def regex(response: str, task: dict[str, Any]) -> float:
    """1.0 when `task["pattern"]` matches the stripped response.

    `task["match"]`: "fullmatch" (default: the whole response must have the format) or "search".
    """
    try:
        pattern = re.compile(str(task["pattern"]), re.DOTALL)
    except re.error as exc:
        raise InvalidRequestError(f"regex verifier: bad pattern: {exc}", param="task") from exc
    mode = task.get("match", "fullmatch")
    if mode not in ("fullmatch", "search"):
        raise InvalidRequestError("regex verifier: match must be fullmatch or search", param="task")
    return 1.0 if getattr(pattern, mode)(response.strip()) else 0.0


def json_schema(response: str, task: dict[str, Any]) -> float:
    """1.0 when the response is JSON (bare or in a ```json fence) valid under `task["schema"]`.

    Invalid JSON or a schema violation is 0.0; an invalid schema is the task's error.
    """
    import jsonschema  # noqa: PLC0415

    schema = task["schema"]
    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequestError(
            f"json_schema verifier: invalid schema: {exc.message}", param="task"
        ) from exc
    fence = _JSON_FENCE.search(response)
    try:
        document = json.loads(fence.group(1) if fence else response.strip())
    except json.JSONDecodeError:
        return 0.0
    return 1.0 if validator_cls(schema).is_valid(document) else 0.0


VERIFIERS: dict[str, Callable[[str, dict[str, Any]], float]] = {
    "last_integer": last_integer,
    "exact": exact,
    "math": math_answer,
    "numeric": numeric,
    "regex": regex,
    "json_schema": json_schema,
    "code_tests": code_tests,
}


REQUIRED_KEY: dict[str, str] = {"regex": "pattern", "json_schema": "schema", "code_tests": "tests"}
"""Task field a verifier needs, when not "answer"."""
