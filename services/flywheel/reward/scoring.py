"""Score one Sample from every configured component and combine them by weight.

Components (each kept by name in `Sample.rewards`):
- "verifier": the task's verifiable reward on the last assistant reply (flywheel.reward.verifiers),
  or a user-defined reward of that name (flywheel.core.rewards, `reward.plugins`): one that
  raises, returns NaN/inf, a non-number or a value outside its declared range leaves the Sample
  unscored (`has_reward = false`, `error` = "reward <name> <reason>: ..."), never 0;
- "<name>": a user-defined reward listed in `reward.components`, run on every Sample (the same
  failure rule);
- "outcome": posted by an environment on the gateway (already in `rewards`); passed through;
- "judge": next-state PRM on a live-mode turn (the Sample has a `next_state`), m votes;
- "step": episodes (no `next_state`): the next-state PRM on every assistant turn that a user or
  tool message follows. Per-turn values go to "step/<k>" (k = 0-based index of the assistant
  message among the Sample's assistant messages, which is also the k-th sampled run of its
  loss mask when every assistant message was sampled): segment rewards for the trainer. "step"
  itself is their mean, present only when every such turn was judged;
- "rubric": outcome judge on the final reply when the task gives a "rubric" (or the settings a
  default one), a score in the declared range.

The combined scalar `reward` is the weighted sum of the top-level components present (names
without "/"; weights from settings, missing = 1.0). A Sample with no component keeps
`has_reward = false` and an `error` saying why; it is never scored as 0. A configured judge with
no valid vote makes the Sample *unjudged*: `has_reward = false`, `error` = "unjudged: <judge>
<infra|parse>/<kind>...", every vote and every other component kept, and `reward` set to the
weighted sum of the components that are present (what a trainer configured to keep unjudged
samples trains on; see `is_unjudged`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from flywheel._proto import sample_pb2
from flywheel.core.errors import InvalidRequestError
from flywheel.core.rewards import REGISTRY, RewardRegistry, RewardSpec
from flywheel.reward import metrics
from flywheel.reward.judge import Judgment, NextStateJudge, RubricJudge
from flywheel.reward.plugins import run_plugin
from flywheel.reward.verifiers import REQUIRED_KEY, VERIFIERS

UNJUDGED_PREFIX = "unjudged:"


def is_unjudged(sample: sample_pb2.Sample) -> bool:
    """True when a configured judge gave no valid vote (the Sample's other components and the
    partial weighted `reward` are kept)."""
    return not sample.has_reward and sample.error.startswith(UNJUDGED_PREFIX)


def message_text(message: sample_pb2.Message) -> str:
    """Content of a message as text, with any tool calls appended as JSON."""
    content = json.loads(message.content_json or "null")
    text = content if isinstance(content, str) else ("" if content is None else json.dumps(content))
    extra = json.loads(message.extra_json or "{}")
    if isinstance(extra, dict) and extra.get("tool_calls"):
        text += f"\n[tool_calls] {json.dumps(extra['tool_calls'])}"
    return text


def last_reply(sample: sample_pb2.Sample) -> str:
    """Text content of the last assistant message of the Sample ("" if none)."""
    for message in reversed(sample.messages):
        if message.role == "assistant":
            content = json.loads(message.content_json or "null")
            return content if isinstance(content, str) else ""
    return ""


def transcript(messages: list[sample_pb2.Message], budget_chars: int = 0) -> str:
    """ "role: text" lines of `messages`, trimmed to `budget_chars` by whole messages.

    The newest messages are kept (a judge needs the latest context most); older ones are
    replaced by one "[N earlier messages omitted]" line. If the newest message alone is over the
    budget, its last `budget_chars` characters are kept. 0 = no limit.
    Lines "user: aaaa", "assistant: bb", "user: c" with budget 21 -> "[1 earlier messages
    omitted]", "assistant: bb", "user: c" (13 + 1 + 7 = 21 fits; one more line, 10 + 1, would
    not).
    """
    lines = [f"{m.role}: {message_text(m)}" for m in messages]
    if not budget_chars or sum(len(x) + 1 for x in lines) - 1 <= budget_chars:
        return "\n".join(lines)
    kept: list[str] = []
    used = 0
    for line in reversed(lines):
        if used + len(line) + (1 if kept else 0) > budget_chars:
            break
        kept.append(line)
        used += len(line) + (1 if len(kept) > 1 else 0)
    if not kept:
        return f"[{len(lines) - 1} earlier messages omitted]\n...{lines[-1][-budget_chars:]}"
    return "\n".join([f"[{len(lines) - len(kept)} earlier messages omitted]", *kept[::-1]])


@dataclass
class Scorer:
    """The configured scorers; `score` is safe to run concurrently on many Samples.

    Args:
        default_verifier: verifier for tasks that name none; "none" = no verifier.
        weights: component name -> weight of the combined reward (missing = 1.0).
        judge: next-state PRM for live turns; None = off.
        step_judge: per-turn PRM for episodes; None = off.
        rubric_judge: rubric outcome judge; None = off.
        default_rubric: rubric used when the task gives none; "" = judge only tasks with one.
        plugins: user-defined rewards, selectable by name like verifiers.
        components: names in `plugins` run on every Sample, each its own component.
    """

    default_verifier: str = "last_integer"
    weights: dict[str, float] = field(default_factory=dict)
    judge: NextStateJudge | None = None
    step_judge: NextStateJudge | None = None
    rubric_judge: RubricJudge | None = None
    default_rubric: str = ""
    plugins: RewardRegistry = field(default_factory=lambda: REGISTRY)
    components: tuple[str, ...] = ()

    async def score(self, sample: sample_pb2.Sample) -> sample_pb2.Sample:
        """Fill `rewards`, `reward`, `has_reward`, `votes` (and `error`); returns the Sample.

        Task errors (unreadable task, unknown verifier) become the Sample's `error`, never an
        exception; an exception here is a bug in a scorer (the worker dead-letters the entry).
        """
        start = time.perf_counter()
        errors: list[str] = []
        unjudged: list[str] = []
        failed: list[str] = []
        task = _task(sample, errors)
        truncated = sample.finish_reason == "length"
        jobs = [self._verify(sample, task, errors, failed)]
        jobs += [self._component(sample, task, name, failed) for name in self.components]
        if self.judge is not None and sample.HasField("next_state"):
            jobs.append(self._judge_live(sample, truncated, unjudged))
        if self.step_judge is not None and not sample.HasField("next_state"):
            jobs.append(self._judge_steps(sample, unjudged))
        rubric = task.get("rubric", self.default_rubric)
        if self.rubric_judge is not None and isinstance(rubric, str) and rubric:
            jobs.append(self._judge_rubric(sample, rubric, truncated, unjudged))
        await asyncio.gather(*jobs)
        self._combine(sample, errors, unjudged, failed)
        metrics.SCORE_SECONDS.observe(time.perf_counter() - start)
        return sample

    def _combine(
        self, sample: sample_pb2.Sample, errors: list[str], unjudged: list[str], failed: list[str]
    ) -> None:
        bad = {k: v for k, v in sample.rewards.items() if not math.isfinite(v)}
        for name, value in bad.items():  # a NaN or inf would poison a whole training step
            del sample.rewards[name]
            errors.append(
                f"reward component {name!r} is {value}, not a finite number: the "
                "Sample is left unscored"
            )
        top = {k: v for k, v in sample.rewards.items() if "/" not in k}
        for name, value in top.items():
            metrics.COMPONENT.labels(name).observe(value)
        sample.reward = sum(self.weights.get(k, 1.0) * v for k, v in top.items())
        if bad or failed:
            sample.has_reward = False
            errors[:0] = failed
        elif unjudged:
            sample.has_reward = False
            errors.insert(0, f"{UNJUDGED_PREFIX} {'; '.join(unjudged)}")
        elif top:
            sample.has_reward = True
        else:
            sample.has_reward = False
            errors.append("no reward component: the task gives no answer and no outcome was posted")
        sample.error = "; ".join(errors)

    async def _verify(
        self, sample: sample_pb2.Sample, task: dict[str, Any], errors: list[str], failed: list[str]
    ) -> None:
        name = task.get("verifier", self.default_verifier)
        if not isinstance(name, str):
            errors.append(f"task 'verifier' must be a string, got {name!r}")
            return
        spec = self.plugins.get(name)
        if spec is not None:  # a user-defined reward reads what it declared; it needs no answer
            await self._plugin(sample, task, spec, "verifier", failed)
            return
        if name == "none" or REQUIRED_KEY.get(name, "answer") not in task:
            return
        verifier = VERIFIERS.get(name)
        if verifier is None:
            known = sorted([*VERIFIERS, *self.plugins.names()])
            errors.append(f"unknown verifier {name!r}; known: {known}")
            return
        try:  # off the event loop: code tests run a sandboxed subprocess for seconds
            sample.rewards["verifier"] = await asyncio.to_thread(verifier, last_reply(sample), task)
        except InvalidRequestError as exc:
            errors.append(str(exc))
        except Exception as exc:  # a task the verifier cannot read: unscored, never a crash
            errors.append(f"verifier {name!r} failed on this task: {type(exc).__name__}: {exc}")

    async def _component(
        self, sample: sample_pb2.Sample, task: dict[str, Any], name: str, failed: list[str]
    ) -> None:
        spec = self.plugins.get(name)
        if spec is None:  # the factory checks names at start; a hand-built Scorer may not
            failed.append(f"reward {name} unknown: no plugin registers it")
            return
        await self._plugin(sample, task, spec, name, failed)

    async def _plugin(
        self,
        sample: sample_pb2.Sample,
        task: dict[str, Any],
        spec: RewardSpec,
        component: str,
        failed: list[str],
    ) -> None:
        """Run a user-defined reward into `rewards[component]`, or its failure into `failed`."""
        result = await run_plugin(spec, sample, task, last_reply(sample))
        if result.value is None:
            failed.append(f"reward {spec.name} {result.reason}: {result.detail}")
        else:
            sample.rewards[component] = result.value

    async def _judge_live(
        self, sample: sample_pb2.Sample, truncated: bool, unjudged: list[str]
    ) -> None:
        messages = list(sample.messages)
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
        if last is None:
            unjudged.append("judge: the sample has no assistant message")
            return
        assert self.judge is not None
        result = await self.judge.judge(
            transcript(messages[:last], self.judge.context_chars),
            message_text(messages[last]),
            message_text(sample.next_state),
            sample.next_state.role,
            truncated=truncated,
        )
        _record(sample, "judge", result, unjudged)

    async def _judge_steps(self, sample: sample_pb2.Sample, unjudged: list[str]) -> None:
        assert self.step_judge is not None
        messages = list(sample.messages)
        turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
        jobs = {}
        for k, i in enumerate(turns):
            after = []
            for m in messages[i + 1 :]:
                if m.role == "assistant":
                    break
                after.append(m)
            if after:  # the final turn has no next state: the outcome components cover it
                jobs[k] = self.step_judge.judge(
                    transcript(messages[:i], self.step_judge.context_chars),
                    message_text(messages[i]),
                    "\n".join(message_text(m) for m in after),
                    after[0].role,
                    label=f"step/{k}",
                )
        if not jobs:
            return
        results = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
        failed = []
        for k, result in results.items():
            sample.votes.extend(result.votes)
            if result.value is None:
                failed.append(f"step/{k} {result.error}")
            else:
                sample.rewards[f"step/{k}"] = result.value
        if failed:
            unjudged.extend(failed)
        else:
            values = [r.value for r in results.values() if r.value is not None]
            sample.rewards["step"] = sum(values) / len(values)

    async def _judge_rubric(
        self, sample: sample_pb2.Sample, rubric: str, truncated: bool, unjudged: list[str]
    ) -> None:
        assert self.rubric_judge is not None
        messages = list(sample.messages)
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
        if last is None:
            unjudged.append("rubric: the sample has no assistant message")
            return
        result = await self.rubric_judge.judge(
            transcript(messages[:last], self.rubric_judge.context_chars),
            message_text(messages[last]),
            rubric,
            truncated=truncated,
        )
        _record(sample, "rubric", result, unjudged)


def _record(sample: sample_pb2.Sample, name: str, result: Judgment, unjudged: list[str]) -> None:
    sample.votes.extend(result.votes)
    if result.value is None:
        unjudged.append(
            f"{name} {result.error} ({result.prompt}, 0 of {len(result.votes)} votes valid)"
        )
    else:
        sample.rewards[name] = result.value


def _task(sample: sample_pb2.Sample, errors: list[str]) -> dict[str, Any]:
    try:
        task = json.loads(sample.task_json or "{}")
    except json.JSONDecodeError as exc:
        errors.append(f"task metadata is not JSON: {exc}")
        return {}
    if not isinstance(task, dict):
        errors.append("task metadata must be a JSON object")
        return {}
    return task


def score_sample(
    sample: sample_pb2.Sample, default_verifier: str, weights: dict[str, float] | None = None
) -> sample_pb2.Sample:
    """Synchronous convenience for verifier/outcome-only scoring (no judges)."""
    return asyncio.run(Scorer(default_verifier, dict(weights or {})).score(sample))
