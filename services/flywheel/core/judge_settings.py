"""Settings of the OpenAI-compatible judges: the reward service's next-state and rubric judges
and the teacher's hint judge (sections of `flywheel.core.settings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flywheel.core.section import Section

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class JudgeSettings(Section):
    """An OpenAI-compatible judge endpoint and its voting policy (flywheel.reward.judge)."""

    enabled: bool = False
    """Off = no "judge" component; samples are scored by verifiers and outcomes only."""
    base_url: str = "http://127.0.0.1:30000/v1"
    """Endpoint root including /v1; POST {base_url}/chat/completions."""
    model: str = DEFAULT_MODEL_NAME
    """Model name sent to the endpoint."""
    api_key: str | None = None
    """Bearer token; None = no Authorization header (local engines)."""
    prompt: str = "prm_v2"
    """Prompt file stem under flywheel/reward/prompts/; recorded as "prm@v2" in each Vote."""
    votes: int = Field(3, ge=1, le=16)
    """m: concurrent judge calls per turn; majority, ties -> mean of the tied values."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds per judge HTTP call (the whole call)."""
    max_concurrency: int = Field(8, ge=1)
    """This judge's calls in flight at once from this process."""
    max_attempts: int = Field(3, ge=1, le=10)
    """Tries per vote on timeout/connection error/429/5xx/unparseable reply (1 = no retry)."""
    backoff_s: float = Field(0.5, ge=0)
    """First retry backoff in seconds; doubles per try with jitter, capped at 30x."""
    temperature: float = Field(0.7, ge=0)
    """Sampling temperature of the judge (votes need diversity)."""
    max_tokens: int = Field(512, ge=16)
    """Max tokens per judge reply (reasoning + final verdict line)."""
    context_chars: int = Field(8000, ge=0)
    """Budget of the context shown to the judge, in characters (about 4 per token): whole
    messages, newest first, older ones replaced by an "[N earlier messages omitted]" line."""


class RubricJudgeSettings(JudgeSettings):
    """A rubric outcome judge: a score in the declared range [score_min, score_max]."""

    prompt: str = "rubric_v1"
    """Prompt file stem; recorded as "rubric@v1" in each Vote."""
    score_min: float = 0.0
    """Lowest valid score; a vote below it is invalid (never clipped)."""
    score_max: float = 10.0
    """Highest valid score; a vote above it is invalid (never clipped)."""
    default_rubric: str = ""
    """Rubric for tasks that give none; "" = only tasks with a "rubric" are judged."""

    @model_validator(mode="after")
    def _range(self) -> RubricJudgeSettings:
        if not self.score_min < self.score_max:
            raise ValueError(f"score_min {self.score_min} must be below score_max {self.score_max}")
        return self


class HintJudgeSettings(JudgeSettings):
    """The teacher's hindsight-hint judge (flywheel.teacher.hints): an OpenAI-compatible endpoint,
    m votes, a fixed reply format and a selection rule."""

    prompt: str = "hint_v1"
    """Prompt file stem under flywheel/teacher/prompts/."""
    selection: Literal["longest", "most_agreed", "none"] = "longest"
    """longest = the longest valid hint; most_agreed = the hint most votes gave (needs a
    majority of valid decisions for a hint); none = never a hint."""
    min_chars: int = Field(10, ge=1)
    """Hints shorter than this many characters are invalid votes."""
