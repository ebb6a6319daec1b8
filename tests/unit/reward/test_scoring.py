import json

import pytest

from flywheel.core.codec import new_sample
from flywheel.reward.scoring import score_sample
from flywheel.reward.verifiers import exact, last_integer


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("8", 1.0),
        ("7 + 1 = 8", 1.0),  # the last integer is 8
        ("The answer is 8.", 1.0),
        ("8, or maybe 9", 0.0),  # the last integer is 9
        ("eight", 0.0),  # no integer at all
        ("1,008", 0.0),  # thousands separator removed: 1008 != 8
    ],
)
def test_last_integer(reply, expected):
    assert last_integer(reply, {"answer": 8}) == expected


def test_exact_strips_whitespace():
    assert exact(" 8\n", {"answer": 8}) == 1.0
    assert exact("8.", {"answer": 8}) == 0.0


def _sample(reply, task):
    s = new_sample(task_json=json.dumps(task))
    s.messages.add(role="user", content_json=json.dumps("What is 7 + 1?"))
    s.messages.add(role="assistant", content_json=json.dumps(reply))
    return s


def test_verifier_and_outcome_are_combined_by_weight():
    s = _sample("8", {"answer": 8})
    s.rewards["outcome"] = 0.5
    score_sample(s, "last_integer", weights={"outcome": 2.0})
    # 1.0 * verifier(1.0) + 2.0 * outcome(0.5) = 2.0
    assert s.reward == pytest.approx(2.0)
    assert s.has_reward and dict(s.rewards) == {"verifier": 1.0, "outcome": 0.5}


def test_no_answer_and_no_outcome_is_unscored_not_zero():
    s = score_sample(_sample("8", {}), "last_integer")
    assert not s.has_reward
    assert "no reward component" in s.error


def test_unknown_verifier_is_an_error_not_a_zero():
    s = score_sample(_sample("8", {"answer": 8, "verifier": "nope"}), "last_integer")
    assert not s.has_reward and "unknown verifier" in s.error


@pytest.mark.parametrize(
    "task",
    [{"answer": "eight"}, {"answer": None}, {"verifier": [1]}, {"answer": 8, "verifier": {"x": 1}}],
)
def test_unreadable_task_is_unscored_not_a_crash(task):
    s = score_sample(_sample("8", task), "last_integer")
    assert not s.has_reward and s.error


def _msgs(*pairs):
    s = new_sample()
    for role, text in pairs:
        s.messages.add(role=role, content_json=json.dumps(text))
    return list(s.messages)


def test_transcript_trims_whole_messages_newest_first():
    from flywheel.reward.scoring import transcript  # noqa: PLC0415

    msgs = _msgs(("user", "aaaa"), ("assistant", "bb"), ("user", "c"))
    # lines of 10, 13 and 7 characters: 13 + 1 + 7 = 21 fits a budget of 21, 10 + 1 more not
    assert transcript(msgs, 21) == "[1 earlier messages omitted]\nassistant: bb\nuser: c"
    assert transcript(msgs, 32) == "user: aaaa\nassistant: bb\nuser: c"  # 10+1+13+1+7 = 32
    assert transcript(msgs, 0) == transcript(msgs, 32)  # 0 = no limit
    # the newest message alone is over the budget: its tail is kept
    assert transcript(msgs, 5) == "[2 earlier messages omitted]\n...er: c"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_reward_component_leaves_the_sample_unscored(value):
    s = _sample("8", {"answer": 8})
    s.rewards["outcome"] = value
    score_sample(s, "last_integer")
    # the verifier's 1.0 alone would score it; a NaN/inf outcome must not be summed, nor kept
    # for the trainer, where it would make the whole step's loss non-finite
    assert not s.has_reward and "'outcome' is" in s.error and "not a finite number" in s.error
    assert dict(s.rewards) == {"verifier": 1.0}
