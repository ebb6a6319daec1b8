"""Next-state PRM judge (OpenClaw-RL style) over any OpenAI-compatible chat endpoint.

One turn is judged by `votes` concurrent calls. Each reply is parsed strictly: only its last
non-empty line counts and it must read `Final verdict: <v>` with v in the declared set
{-1, 0, +1}; anything else is an invalid vote ("parse"). Timeouts, connection errors, 429 and
5xx are retried with exponential backoff and jitter, then the vote is invalid ("infra").

Aggregation: majority of the valid votes; on a tie, the mean of the tied values (so +1 vs -1
gives 0.0, +1 vs 0 gives 0.5: no side wins a tie). No valid vote = the turn is *unjudged*,
never 0.0 (field-failures BUG-20, BUG-22); the reason is "infra" when every vote failed on
infrastructure, else "parse".

The judged text goes inside blocks delimited by a random per-call nonce, so a response cannot
close the block, and a verdict line planted in the response is never the judge's last line.

Prompts are versioned files `prompts/<name>_v<N>.txt` (string.Template: $context, $response,
$next_state, $next_role, $nonce); each Vote's `judge` field records "<name>@v<N>".
To change a prompt, add a new version file; never edit a released one.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from string import Template

import httpx
import tenacity
from prometheus_client import Counter as MetricCounter

from flywheel._proto import sample_pb2
from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import JudgeSettings

log = logging.getLogger(__name__)
PROMPTS = Path(__file__).parent / "prompts"
VERDICTS = (-1, 0, 1)
_VERDICT_LINE = re.compile(r"final\s+verdict\s*:\s*([+-]?\d+(?:\.\d+)?)\s*\.?", re.IGNORECASE)
JUDGE_VOTES = MetricCounter("flywheel_reward_judge_votes_total", "Judge votes", ["outcome"])


class JudgeInfraError(Exception):
    """Transient: timeout, connection error, 429 or 5xx. Retried, then an "infra" vote."""


@dataclass(frozen=True)
class Verdict:
    value: int | None
    """The verdict in VERDICTS; None = invalid."""
    reason: str
    """"ok", or why the vote is invalid, prefixed "parse:" or "infra:"."""


@dataclass(frozen=True)
class Judgment:
    value: float | None
    """Aggregated verdict; None = unjudged."""
    votes: list[sample_pb2.Vote]
    error: str
    """"" when judged, else "infra" or "parse"."""


def parse_verdict(reply: str, allowed: tuple[int, ...] = VERDICTS) -> Verdict:
    """Parse only the last non-empty line of a judge reply.

    "...\\nFinal verdict: +1" -> 1; "**Final verdict: -1**" -> -1; "Final verdict: 10" -> invalid
    (out of set); "Reward: 1" or a verdict followed by more text -> invalid (no final line).
    """
    lines = [ln.strip().strip("*`_ ").strip() for ln in reply.strip().splitlines() if ln.strip()]
    if not lines:
        return Verdict(None, "parse: empty reply")
    match = _VERDICT_LINE.fullmatch(lines[-1])
    if match is None:
        return Verdict(None, "parse: last line is not 'Final verdict: <v>'")
    text = match.group(1)
    if "." in text or int(text) not in allowed:
        return Verdict(None, f"parse: verdict {text} not in {list(allowed)}")
    return Verdict(int(text), "ok")


def aggregate(values: list[int]) -> float | None:
    """Majority of valid votes; tie -> mean of the tied values; no votes -> None.

    [1, 1, -1] -> 1.0; [1, -1] -> 0.0; [1, 0] -> 0.5; [] -> None.
    """
    if not values:
        return None
    counts = Counter(values).most_common()
    top = [v for v, n in counts if n == counts[0][1]]
    return sum(top) / len(top)


def load_prompt(name: str) -> tuple[str, Template]:
    """(version tag, template) of `prompts/<name>.txt`; "prm_v1" -> ("prm@v1", ...)."""
    path = PROMPTS / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in PROMPTS.glob("*.txt"))
        raise ConfigurationError(f"judge prompt {name!r} not found; known: {known}")
    base, _, version = name.rpartition("_")
    return f"{base}@{version}", Template(path.read_text())


class JudgeClient:
    """Calls one OpenAI-compatible endpoint; thread-safe, at most `max_concurrency` in flight.

    Args:
        base_url: endpoint root including /v1 (e.g. "http://127.0.0.1:30000/v1").
        model: model name sent in each request.
        api_key: bearer token; None = no Authorization header.
        timeout_s: seconds per HTTP call.
        max_concurrency: calls in flight at once across all threads.
        max_attempts: tries per vote on infra errors (1 = no retry).
        backoff_s: first backoff in seconds, doubled per retry (with jitter), capped at 30x.
        transport: httpx transport override (tests use httpx.MockTransport).
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 30.0, max_concurrency: int = 8, max_attempts: int = 3,
                 backoff_s: float = 0.5, temperature: float = 0.7, max_tokens: int = 512,
                 transport: httpx.BaseTransport | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers,
                                 timeout=timeout_s, transport=transport)
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self.retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max_attempts),
            wait=(tenacity.wait_exponential(multiplier=backoff_s, max=30 * backoff_s)
                  + tenacity.wait_random(0, backoff_s)),
            retry=tenacity.retry_if_exception_type(JudgeInfraError), reraise=True,
        )

    def complete(self, prompt: str) -> str:
        """Text of one chat completion, retried on infra errors; raises JudgeInfraError."""
        return self.retrying(self._complete_once, prompt)

    def _complete_once(self, prompt: str) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        with self.slots:
            try:
                resp = self.http.post("/chat/completions", json=body)
            except httpx.TransportError as exc:  # timeouts, refused connections, resets
                raise JudgeInfraError(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code == 429 or resp.status_code >= 500:
            raise JudgeInfraError(f"HTTP {resp.status_code}")
        if resp.status_code != 200:
            raise ValueError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"not an OpenAI chat completion: {resp.text[:200]}") from exc

    def close(self) -> None:
        self.http.close()


class NextStateJudge:
    """m votes on one turn from its context, response and next state.

    Args:
        client: the endpoint.
        prompt: prompt file stem, e.g. "prm_v1".
        votes: m, concurrent calls per turn.
        context_chars: the context is trimmed to its last `context_chars` characters.
    """

    def __init__(self, client: JudgeClient, prompt: str = "prm_v1", votes: int = 3,
                 context_chars: int = 8000):
        self.client = client
        self.tag, self.template = load_prompt(prompt)
        self.votes = votes
        self.context_chars = context_chars
        self.pool = ThreadPoolExecutor(max_workers=votes, thread_name_prefix="judge")

    def render(self, context: str, response: str, next_state: str, next_role: str) -> str:
        return self.template.substitute(
            nonce=secrets.token_hex(8), context=context[-self.context_chars:],
            response=response, next_state=next_state, next_role=next_role)

    def judge(self, context: str, response: str, next_state: str, next_role: str) -> Judgment:
        prompt = self.render(context, response, next_state, next_role)
        votes = list(self.pool.map(lambda _: self._vote(prompt), range(self.votes)))
        values = [int(v.value) for v in votes if v.has_value]
        value = aggregate(values)
        if value is not None:
            return Judgment(value, votes, "")
        infra = all(v.explanation.startswith("infra:") for v in votes)
        return Judgment(None, votes, "infra" if infra else "parse")

    def _vote(self, prompt: str) -> sample_pb2.Vote:
        try:
            reply = self.client.complete(prompt)
        except JudgeInfraError as exc:
            JUDGE_VOTES.labels("infra").inc()
            return sample_pb2.Vote(judge=self.tag, has_value=False, explanation=f"infra: {exc}")
        except ValueError as exc:
            JUDGE_VOTES.labels("parse").inc()
            return sample_pb2.Vote(judge=self.tag, has_value=False, explanation=f"parse: {exc}")
        verdict = parse_verdict(reply)
        if verdict.value is None:
            JUDGE_VOTES.labels("parse").inc()
            return sample_pb2.Vote(judge=self.tag, has_value=False,
                                   explanation=f"{verdict.reason}; reply tail: {reply[-200:]}")
        JUDGE_VOTES.labels("valid").inc()
        return sample_pb2.Vote(judge=self.tag, has_value=True, value=float(verdict.value),
                               explanation=reply[-1000:])


def judge_from_settings(js: JudgeSettings) -> NextStateJudge | None:
    """The configured judge, or None when `js.enabled` is false."""
    if not js.enabled:
        return None
    client = JudgeClient(js.base_url, js.model, api_key=js.api_key, timeout_s=js.timeout_s,
                         max_concurrency=js.max_concurrency, max_attempts=js.max_attempts,
                         backoff_s=js.backoff_s, temperature=js.temperature,
                         max_tokens=js.max_tokens)
    return NextStateJudge(client, js.prompt, js.votes, js.context_chars)
