"""Reward settings -> scorers: every enabled judge gets its own endpoint and limits; secrets are
not logged; bad ranges and unknown prompts fail at start-up."""

import pydantic
import pytest

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import load_settings
from flywheel.reward.factory import build_scorer
from flywheel.reward.main import _redacted


def test_each_enabled_judge_has_its_own_client_and_limits():
    settings = load_settings(
        reward={
            "judge": {
                "enabled": True,
                "base_url": "http://a:1/v1",
                "model": "big",
                "votes": 5,
                "timeout_s": 7,
                "max_concurrency": 3,
                "api_key": "sk-a",
            },
            "rubric_judge": {
                "enabled": True,
                "base_url": "http://b:2/v1/",
                "score_min": 1,
                "score_max": 5,
            },
        }
    )
    scorer = build_scorer(settings.reward)
    assert scorer.step_judge is None
    j, r = scorer.judge, scorer.rubric_judge
    assert (
        j.client.base_url,
        j.client.model,
        j.votes,
        j.client.timeout_s,
        j.client.max_concurrency,
        j.client.api_key,
    ) == ("http://a:1/v1", "big", 5, 7.0, 3, "sk-a")
    assert j.tag == "prm@v2" and r.tag == "rubric@v1"
    assert r.client.base_url == "http://b:2/v1" and (r.low, r.high) == (1.0, 5.0)
    assert r.client is not j.client


def test_api_keys_are_redacted_from_the_logged_settings():
    settings = load_settings(reward={"judge": {"api_key": "sk-secret-123"}})
    text = _redacted(settings)
    assert "sk-secret-123" not in text and "<redacted>" in text


def test_bad_rubric_range_and_unknown_prompt_fail_at_start_up():
    with pytest.raises(pydantic.ValidationError, match="score_min"):
        load_settings(reward={"rubric_judge": {"score_min": 5, "score_max": 5}})
    settings = load_settings(reward={"judge": {"enabled": True, "prompt": "prm_v99"}})
    with pytest.raises(ConfigurationError, match="known"):
        build_scorer(settings.reward)
