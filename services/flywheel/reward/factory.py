"""Settings -> the configured Scorer (one AsyncJudgeClient per enabled judge, each with its own
endpoint, key, concurrency limit and timeout)."""

from __future__ import annotations

from flywheel.core.errors import ConfigurationError
from flywheel.core.judge_client import AsyncJudgeClient
from flywheel.core.rewards import REGISTRY, VERIFIER_NAMES, load_plugins
from flywheel.core.settings import JudgeSettings, RewardSettings
from flywheel.reward import metrics
from flywheel.reward.judge import NextStateJudge, RubricJudge
from flywheel.reward.scoring import Scorer


def judge_client(js: JudgeSettings, name: str) -> AsyncJudgeClient:
    """The HTTP client of one judge section."""
    return AsyncJudgeClient(
        js.base_url,
        js.model,
        metrics=metrics.JUDGE_CALLS,
        name=name,
        api_key=js.api_key,
        timeout_s=js.timeout_s,
        max_concurrency=js.max_concurrency,
        max_attempts=js.max_attempts,
        backoff_s=js.backoff_s,
        temperature=js.temperature,
        max_tokens=js.max_tokens,
    )


def build_scorer(rs: RewardSettings) -> Scorer:
    """Scorer with the default verifier, weights, user-defined components and every enabled
    judge.

    Raises:
        ConfigurationError: a judge names a prompt file that does not exist.
    """
    judge = step = rubric = None
    if rs.judge.enabled:
        judge = NextStateJudge(
            judge_client(rs.judge, "judge"), rs.judge.prompt, rs.judge.votes, rs.judge.context_chars
        )
    if rs.step_judge.enabled:
        sj = rs.step_judge
        step = NextStateJudge(judge_client(sj, "step"), sj.prompt, sj.votes, sj.context_chars)
    if rs.rubric_judge.enabled:
        rj = rs.rubric_judge
        rubric = RubricJudge(
            judge_client(rj, "rubric"),
            rj.prompt,
            rj.votes,
            rj.score_min,
            rj.score_max,
            rj.context_chars,
        )
    return Scorer(
        rs.default_verifier,
        dict(rs.weights),
        judge,
        step,
        rubric,
        rs.rubric_judge.default_rubric,
        components=tuple(rs.components),
    )


def load_reward_plugins(rs: RewardSettings) -> list[str]:
    """Import the modules in `rs.plugins` (their `@reward` functions register themselves) and
    check that `rs.default_verifier` names a verifier that exists now.

    Returns:
        The user-defined reward names registered, sorted.

    Raises:
        ConfigurationError: a plugin module cannot be imported or registers a bad reward, or the
            default verifier is neither built in nor registered by a plugin.
    """
    names = load_plugins(rs.plugins)
    if rs.default_verifier not in VERIFIER_NAMES and rs.default_verifier not in REGISTRY:
        raise ConfigurationError(
            f"reward.default_verifier {rs.default_verifier!r} is not a verifier: built in are "
            f"{', '.join(VERIFIER_NAMES)}; the plugins {rs.plugins} register "
            f"{names or 'nothing'}"
        )
    unknown = [c for c in rs.components if c not in REGISTRY]
    if unknown:
        raise ConfigurationError(
            f"reward.components {unknown} are not registered by the plugins {rs.plugins} "
            f"(they register {names or 'nothing'})"
        )
    return names
