"""Hindsight hints: a judge LLM reads a turn's next state and, when it says how the response
should have been different, writes a short hint in a fixed format (OpenClaw-RL's hindsight-guided
OPD). `votes` judge calls per turn; a selection rule picks one hint or none.

Reply format (prompts/hint_v<N>.txt): the last non-empty line is the decision,
`Decision: \\boxed{1}` (a hint is given) or `Decision: \\boxed{-1}` (no hint); with decision 1
the reply holds exactly one block `[HINT_START] <hint> [HINT_END]`. Parsing is strict:
- no decision line, or a decision other than +-1 -> invalid vote ("parse");
- decision 1 with no block, an unclosed block, or START/END out of order -> invalid
  ("missing markers"); two or more blocks -> invalid ("multiple hint blocks", ambiguous);
  a blank hint -> invalid ("empty hint"); shorter than `min_chars` -> invalid ("too short");
- decision -1 -> a valid vote for "no hint" (any block is ignored).

Selection rules (`HintSettings.selection`):
- `longest`: the longest valid hint among the votes (OpenClaw-RL's rule); ties -> the first;
- `most_agreed`: the valid decisions must be a strict majority of 1; then the hint text given
  by most votes (compared after collapsing whitespace and case); ties -> the longest;
- `none`: never a hint (the judge is not called).

A turn without a valid hint is not dropped: the pipeline records it (`teacher_status` "no_hint",
metric `flywheel_teacher_hints_total`). Judge transport is `flywheel.core.judge_client.JudgeClient`
(retries, backoff, concurrency limit; metrics `flywheel_teacher_judge_*{judge="hint"}`), the
client the reward service's judges also use.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Literal

from flywheel._proto import sample_pb2
from flywheel.core.errors import ConfigurationError
from flywheel.core.judge_client import JudgeClient, JudgeInfraError
from flywheel.teacher import metrics
from flywheel.teacher.context import message_dicts, text_of, turn_context

PROMPTS = Path(__file__).parent / "prompts"
START, END = "[HINT_START]", "[HINT_END]"
_DECISION = re.compile(r"decision\s*:\s*\\boxed\{\s*([+-]?\d+)\s*\}\s*\.?", re.IGNORECASE)
Selection = Literal["longest", "most_agreed", "none"]


@dataclass(frozen=True)
class HintVote:
    decision: int | None
    """1 = hint given, -1 = no hint, None = invalid vote."""
    hint: str
    """The hint text of a valid decision-1 vote, else ""."""
    reason: str
    """"ok" or why the vote is invalid ("parse: ..." or "infra: ...")."""


@dataclass(frozen=True)
class HintResult:
    hint: str
    """The selected hint; "" = none."""
    status: str
    """"hint", "no_hint" (valid votes, no usable hint), "unjudged" (no valid vote),
    "no_next_state"."""
    votes: list[HintVote] = field(default_factory=list)


def parse_hint_reply(reply: str, min_chars: int = 10) -> HintVote:
    """Parse one judge reply strictly (see the module docstring for the table)."""
    lines = [ln.strip().strip("*`_ ").strip() for ln in reply.strip().splitlines() if ln.strip()]
    if not lines:
        return HintVote(None, "", "parse: empty reply")
    match = _DECISION.fullmatch(lines[-1])
    if match is None:
        return HintVote(None, "", "parse: last line is not 'Decision: \\boxed{1|-1}'")
    decision = int(match.group(1))
    if decision not in (1, -1):
        return HintVote(None, "", f"parse: decision {decision} is not 1 or -1")
    if decision == -1:
        return HintVote(-1, "", "ok")
    starts, ends = reply.count(START), reply.count(END)
    if starts > 1 or ends > 1:
        return HintVote(None, "", "parse: multiple hint blocks")
    if starts != 1 or ends != 1 or reply.index(START) > reply.index(END):
        return HintVote(
            None, "", f"parse: missing markers (decision 1 needs one {START} ... {END} block)"
        )
    hint = reply[reply.index(START) + len(START) : reply.index(END)].strip()
    if not hint:
        return HintVote(None, "", "parse: empty hint")
    if len(hint) < min_chars:
        return HintVote(None, "", f"parse: hint shorter than {min_chars} characters")
    return HintVote(1, hint, "ok")


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def select_hint(votes: list[HintVote], rule: Selection) -> str:
    """The hint the rule picks from the votes, or "" for none (see the module docstring).

    longest: [1:"ab..", 1:"abc..", -1] -> "abc.."; most_agreed: [1:"x", 1:"x", 1:"yy"] -> "x",
    [1:"x", -1, -1] -> "" (no majority for a hint).
    """
    hints = [v.hint for v in votes if v.decision == 1 and v.hint]
    if rule == "none" or not hints:
        return ""
    if rule == "longest":
        return max(hints, key=len)
    valid = [v for v in votes if v.decision is not None]
    if 2 * len(hints) <= len(valid):
        return ""
    counts = Counter(_norm(h) for h in hints)
    best = max(counts.values())
    tied = [h for h in hints if counts[_norm(h)] == best]
    return max(tied, key=len)


def load_hint_prompt(name: str) -> Template:
    """The template of `prompts/<name>.txt` ($context, $response, $next_state, $next_role,
    $nonce).

    Raises:
        ConfigurationError: no such prompt file.
    """
    path = PROMPTS / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in PROMPTS.glob("*.txt"))
        raise ConfigurationError(f"hint prompt {name!r} not found; known: {known}")
    return Template(path.read_text())


class HintExtractor:
    """m judge votes on one turn, parsed and reduced by the selection rule.

    Args:
        client: the judge endpoint (OpenAI-compatible chat completions).
        prompt: prompt file stem under teacher/prompts, e.g. "hint_v1".
        votes: m, concurrent calls per turn.
        selection: the selection rule.
        min_chars: hints shorter than this are invalid.
        context_chars: the conversation before the response is trimmed to its last N chars.
    """

    def __init__(
        self,
        client: JudgeClient,
        prompt: str = "hint_v1",
        votes: int = 3,
        selection: Selection = "longest",
        min_chars: int = 10,
        context_chars: int = 8000,
    ):
        self.client = client
        self.template = load_hint_prompt(prompt)
        self.votes = votes
        self.selection = selection
        self.min_chars = min_chars
        self.context_chars = context_chars
        self.pool = ThreadPoolExecutor(max_workers=votes, thread_name_prefix="hint")

    def extract(self, sample: sample_pb2.Sample) -> HintResult:
        """Hint for the Sample's last assistant turn from its `next_state`.

        Raises:
            InvalidRequestError: the Sample has no assistant message.
        """
        if not sample.HasField("next_state") or not sample.next_state.content_json:
            metrics.HINTS.labels("no_next_state").inc()
            return HintResult("", "no_next_state")
        if self.selection == "none":
            metrics.HINTS.labels("no_hint").inc()
            return HintResult("", "no_hint")
        context, response = turn_context(message_dicts(sample.messages))
        rendered = "\n".join(f"{m['role']}: {text_of(m.get('content'))}" for m in context)
        prompt = self.template.substitute(
            nonce=secrets.token_hex(8),
            context=rendered[-self.context_chars :],
            response=response,
            next_state=text_of(message_dicts([sample.next_state])[0].get("content")),
            next_role=sample.next_state.role,
        )
        votes = list(self.pool.map(lambda _: self._vote(prompt), range(self.votes)))
        hint = select_hint(votes, self.selection)
        if hint:
            status = "hint"
        elif any(v.decision is not None for v in votes):
            status = "no_hint"
        else:
            status = "unjudged"
        metrics.HINTS.labels(status).inc()
        return HintResult(hint, status, votes)

    def _vote(self, prompt: str) -> HintVote:
        try:
            reply = self.client.complete(prompt)
        except JudgeInfraError as exc:
            metrics.HINT_VOTES.labels("infra").inc()
            return HintVote(None, "", f"infra: {exc}")
        except ValueError as exc:
            metrics.HINT_VOTES.labels("parse").inc()
            return HintVote(None, "", f"parse: {exc}")
        vote = parse_hint_reply(reply, self.min_chars)
        outcome = {1: "hint", -1: "no_hint", None: "parse"}[vote.decision]
        metrics.HINT_VOTES.labels(outcome).inc()
        return vote
