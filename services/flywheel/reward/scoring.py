"""Score one Sample: verifier reward on its last assistant reply, the next-state judge (when
configured and the Sample has a `next_state`), plus a posted outcome reward.

The combined scalar is the weighted sum of the components present. A Sample with no component
(no verifier applies, no outcome posted) keeps `has_reward = false` and an `error` that says why;
it is never scored as 0. A configured judge that yields no valid vote makes the Sample unjudged:
`has_reward = false`, `error` starting with "infra" or "parse", the other components and every
vote kept for inspection (a hybrid score with a missing judge part is not a real score).
"""

from __future__ import annotations

import json
from typing import Any

from flywheel._proto import sample_pb2
from flywheel.core.errors import InvalidRequestError
from flywheel.reward.judge import NextStateJudge
from flywheel.reward.verifiers import REQUIRED_KEY, VERIFIERS

DEFAULT_WEIGHTS = {"verifier": 1.0, "judge": 1.0, "outcome": 1.0}


def last_reply(sample: sample_pb2.Sample) -> str:
    """Text of the last assistant message of the Sample ("" if none)."""
    for message in reversed(sample.messages):
        if message.role == "assistant":
            content = json.loads(message.content_json or "null")
            return content if isinstance(content, str) else ""
    return ""


def _text(message: sample_pb2.Message) -> str:
    content = json.loads(message.content_json or "null")
    return content if isinstance(content, str) else json.dumps(content)


def judge_turn(sample: sample_pb2.Sample, judge: NextStateJudge) -> str:
    """Add the judge's votes and, when judged, `rewards["judge"]`; returns "" or the reason."""
    messages = list(sample.messages)
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
    if last is None:
        return "judge: the sample has no assistant message"
    context = "\n".join(f"{m.role}: {_text(m)}" for m in messages[:last])
    result = judge.judge(context, _text(messages[last]), _text(sample.next_state),
                         sample.next_state.role)
    sample.votes.extend(result.votes)
    if result.value is not None:
        sample.rewards["judge"] = result.value
    return result.error


def score_sample(
    sample: sample_pb2.Sample,
    default_verifier: str,
    weights: dict[str, float] | None = None,
    judge: NextStateJudge | None = None,
) -> sample_pb2.Sample:
    """Fill `rewards`, `reward`, `has_reward` (and `error` when unscored); returns the Sample.

    Args:
        sample: the Sample; its `task_json` may name a `verifier` and must give the `answer`.
        default_verifier: verifier used when the task names none; "none" = no verifier.
        weights: component name -> weight of the combined reward (default 1.0 each).
        judge: next-state judge; None = disabled. Used only when the Sample has a next_state.
    """
    weights = {**DEFAULT_WEIGHTS, **(weights or {})}
    errors = []
    try:
        task: dict[str, Any] = json.loads(sample.task_json or "{}")
    except json.JSONDecodeError as exc:
        task = {}
        errors.append(f"task metadata is not JSON: {exc}")
    if not isinstance(task, dict):
        errors.append("task metadata must be a JSON object")
        task = {}
    name = task.get("verifier", default_verifier)
    if not isinstance(name, str):
        errors.append(f"task 'verifier' must be a string, got {name!r}")
        name = "none"
    if name != "none" and REQUIRED_KEY.get(name, "answer") in task:
        verifier = VERIFIERS.get(name)
        if verifier is None:
            errors.append(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
        else:
            try:
                sample.rewards["verifier"] = verifier(last_reply(sample), task)
            except InvalidRequestError as exc:
                errors.append(str(exc))
            except Exception as exc:  # a task the verifier cannot read: unscored, never a crash
                errors.append(f"verifier {name!r} failed on this task: {type(exc).__name__}: {exc}")
    unjudged = ""
    if judge is not None and sample.HasField("next_state"):
        unjudged = judge_turn(sample, judge)
    if unjudged:
        sample.has_reward = False
        errors.insert(0, unjudged)
    elif sample.rewards:
        sample.reward = sum(weights.get(k, 1.0) * v for k, v in sample.rewards.items())
        sample.has_reward = True
    else:
        sample.has_reward = False
        errors.append("no reward component: the task gives no answer and no outcome was posted")
    sample.error = "; ".join(errors)
    return sample
