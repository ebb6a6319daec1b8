"""LLM judges over any OpenAI-compatible endpoint: the next-state PRM (OpenClaw-RL style, also
used per turn for episode step scores) and the rubric outcome judge.

A judgment is m concurrent votes on one rendered prompt (flywheel.core.judge_client retries
each vote), parsed strictly (flywheel.reward.parsing) and aggregated:
- verdict judges (declared set {-1, 0, +1}): majority of the valid votes; a tie gives the mean of
  the tied values, so no side wins a tie;
- score judges (declared range [low, high]): mean of the valid votes.
No valid vote = the judgment is *unjudged* (value None) with the most common failure kind as its
reason, never 0.0 (BUG-20, BUG-22).

The judged text goes inside blocks delimited by a random per-call nonce, so a response cannot
close its block, and a verdict line planted in the response is never the judge's last line.

Prompts are versioned files `prompts/<name>_v<N>.txt` (string.Template). Each Vote's `judge` field
records "<label>:<name>@v<N>" (e.g. "judge:prm@v2", "step/1:prm@v2"), so every judgment carries
its prompt version. To change a prompt add a new version file; never edit a released one.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from string import Template

from flywheel._proto import sample_pb2
from flywheel.core.errors import ConfigurationError
from flywheel.core.judge_client import INFRA_KINDS, AsyncJudgeClient, Parsed
from flywheel.reward import metrics
from flywheel.reward.parsing import agreement, majority, mean, parse_score, parse_verdict

PROMPTS = Path(__file__).parent / "prompts"
_KIND_ORDER = (*INFRA_KINDS, "no_verdict", "invalid_value")


@dataclass(frozen=True)
class Judgment:
    value: float | None
    """Aggregated vote; None = unjudged."""
    votes: list[sample_pb2.Vote]
    reason: str
    """"" when judged, else the most common failure kind of the votes (e.g. "timeout")."""
    prompt: str
    """Prompt version, "<name>@v<N>"."""

    @property
    def error(self) -> str:
        """ "" or "infra/<kind>" / "parse/<kind>" for the sample's error text."""
        if not self.reason:
            return ""
        return f"{'infra' if self.reason in INFRA_KINDS else 'parse'}/{self.reason}"


def load_prompt(name: str) -> tuple[str, Template]:
    """(version tag, template) of `prompts/<name>.txt`; "prm_v1" -> ("prm@v1", ...).

    Raises:
        ConfigurationError: no such prompt file (the message lists the known ones).
    """
    path = PROMPTS / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in PROMPTS.glob("*.txt"))
        raise ConfigurationError(f"judge prompt {name!r} not found; known: {known}")
    base, _, version = name.rpartition("_")
    return f"{base}@{version}", Template(path.read_text())


class VotingJudge:
    """m concurrent votes on one prompt, parsed by `parse`, aggregated by `combine`.

    Args:
        client: the endpoint (its own concurrency limit and timeout).
        prompt: prompt file stem, e.g. "prm_v2".
        votes: m.
        parse: reply -> Parsed.
        combine: valid vote values -> aggregated value (None when empty).
    """

    def __init__(
        self,
        client: AsyncJudgeClient,
        prompt: str,
        votes: int,
        parse: Callable[[str], Parsed],
        combine: Callable[[list[float]], float | None],
    ):
        self.client = client
        self.tag, self.template = load_prompt(prompt)
        self.votes = votes
        self.parse = parse
        self.combine = combine

    @property
    def name(self) -> str:
        return self.client.name

    def render(self, **fields: str) -> str:
        """The prompt with `fields` and a fresh nonce; unknown template names raise KeyError."""
        return self.template.substitute(nonce=secrets.token_hex(8), **fields)

    async def run(self, label: str, **fields: str) -> Judgment:
        """Render, vote m times concurrently, aggregate; `label` prefixes each Vote's judge."""
        prompt = self.render(**fields)
        results = await asyncio.gather(
            *(self.client.vote(prompt, self.parse) for _ in range(self.votes))
        )
        judge = f"{label}:{self.tag}"
        votes = [
            sample_pb2.Vote(
                judge=judge,
                has_value=r.value is not None,
                value=r.value or 0.0,
                explanation=r.detail if r.value is not None else f"{r.kind}: {r.detail}",
            )
            for r in results
        ]
        for r in results:
            metrics.VOTES.labels(self.name, "valid" if r.value is not None else r.kind).inc()
        values = [r.value for r in results if r.value is not None]
        value = self.combine(values)
        if value is not None:
            metrics.JUDGED.labels(self.name).inc()
            metrics.AGREEMENT.labels(self.name).observe(agreement(values) or 0.0)
            return Judgment(value, votes, "", self.tag)
        kinds = Counter(r.kind for r in results)
        reason = min(
            kinds,
            key=lambda k: (
                -kinds[k],
                _KIND_ORDER.index(k) if k in _KIND_ORDER else len(_KIND_ORDER),
            ),
        )
        metrics.UNJUDGED.labels(self.name, reason).inc()
        return Judgment(None, votes, reason, self.tag)


class NextStateJudge(VotingJudge):
    """Did the response move the user's goal forward, judging from the next state? +1 / 0 / -1.

    Args:
        client, prompt, votes: as VotingJudge.
        context_chars: the turn's context is trimmed to its last `context_chars` characters.
    """

    def __init__(
        self,
        client: AsyncJudgeClient,
        prompt: str = "prm_v2",
        votes: int = 3,
        context_chars: int = 8000,
    ):
        super().__init__(client, prompt, votes, parse_verdict, majority)
        self.context_chars = context_chars

    async def judge(
        self,
        context: str,
        response: str,
        next_state: str,
        next_role: str,
        *,
        truncated: bool = False,
        label: str = "judge",
    ) -> Judgment:
        """Judge one turn. `truncated`: the response hit the token limit (finish_reason
        "length"); the judge is told so, so a cut-off answer is not graded as complete."""
        return await self.run(
            label,
            context=_last_chars(context, self.context_chars),
            response=response,
            next_state=next_state,
            next_role=next_role,
            response_status=_response_status(truncated),
        )


class RubricJudge(VotingJudge):
    """Outcome judge for open-ended tasks: a score in [low, high] under a rubric.

    Args:
        client, prompt, votes: as VotingJudge.
        low, high: the declared score range; a vote outside it is invalid (never clipped).
        context_chars: the task text is trimmed to its last `context_chars` characters.
    """

    def __init__(
        self,
        client: AsyncJudgeClient,
        prompt: str = "rubric_v1",
        votes: int = 3,
        low: float = 0.0,
        high: float = 10.0,
        context_chars: int = 8000,
    ):
        super().__init__(client, prompt, votes, partial(parse_score, low=low, high=high), mean)
        self.low, self.high = low, high
        self.context_chars = context_chars

    async def judge(
        self,
        task: str,
        response: str,
        rubric: str,
        *,
        truncated: bool = False,
        label: str = "rubric",
    ) -> Judgment:
        """Score one final response against `rubric`."""
        return await self.run(
            label,
            task=_last_chars(task, self.context_chars),
            response=response,
            rubric=rubric,
            low=f"{self.low:g}",
            high=f"{self.high:g}",
            response_status=_response_status(truncated),
        )


def _response_status(truncated: bool) -> str:
    """The prompt's `response_status`: whether the response hit the token limit
    (finish_reason "length"), so a cut-off answer is not graded as complete."""
    if truncated:
        return "cut off at the token limit (finish_reason=length): it is incomplete"
    return "complete"


def _last_chars(text: str, chars: int) -> str:
    """The last `chars` characters of `text`; "" when `chars` is 0 (the prompt shows none)."""
    return text[-chars:] if chars else ""
