"""Judge replies -> votes (BUG-20) and vote aggregation, as tables."""

import pytest

from flywheel.reward.parsing import (
    INVALID_VALUE,
    NO_VERDICT,
    agreement,
    majority,
    mean,
    parse_score,
    parse_verdict,
)


@pytest.mark.parametrize(
    ("reply", "value", "kind"),
    [
        ("The user thanked it.\nFinal verdict: +1", 1.0, "ok"),
        ("Final verdict: 1", 1.0, "ok"),
        ("meh\nFinal verdict: 0", 0.0, "ok"),
        ("The user complained.\n**Final verdict: -1**", -1.0, "ok"),
        ("final verdict:-1.", -1.0, "ok"),  # case, no space, trailing period
        ("Final verdict: **+1**", 1.0, "ok"),  # emphasis around the number
        ("Final verdict: 1.0", 1.0, "ok"),  # 1.0 is the declared value 1
        ("reasoning\n\n  Final verdict: -1  \n\n", -1.0, "ok"),  # blank lines around
        ("Reward: 10", None, NO_VERDICT),  # BUG-20: not the declared form
        ("Reward: 1", None, NO_VERDICT),
        ("Final verdict: 10", None, INVALID_VALUE),  # outside the declared set
        ("Final verdict: 0.5", None, INVALID_VALUE),  # not a member of {-1, 0, 1}
        ("Final verdict: -2", None, INVALID_VALUE),
        ("Final verdict: 1e309", None, INVALID_VALUE),  # inf is not a verdict
        ("Final verdict: +1\nActually, on reflection, it is bad.", None, NO_VERDICT),
        ("Final verdict: -1\n...\nFinal verdict: +1", 1.0, "ok"),  # only the last line counts
        ("Final verdict: +1 because the user was happy", None, NO_VERDICT),
        ("The response says 'Final verdict: +1' but the user left angry.", None, NO_VERDICT),
        ("I cannot grade this.", None, NO_VERDICT),
        ("", None, NO_VERDICT),
        ("   \n  ", None, NO_VERDICT),
    ],
)
def test_verdict_table(reply, value, kind):
    parsed = parse_verdict(reply)
    assert (parsed.value, parsed.kind) == (value, kind)
    assert parsed.detail if value is None else not parsed.detail


# BUG-20's table with this service's label ("Final score"); ranges are the declared scales.
@pytest.mark.parametrize(
    ("reply", "low", "high", "value", "kind"),
    [
        ("Final score: 10", 0, 10, 10.0, "ok"),  # not read as 1
        ("Final score: 1e-1", 0, 1, 0.1, "ok"),  # not read as 1
        ("Final score: -0.5", -1, 1, -0.5, "ok"),
        ("Final score: **0.8**", 0, 1, 0.8, "ok"),
        ("Final score: 0.75.", 0, 10, 0.75, "ok"),
        ("Final score: 5", 0, 10, 5.0, "ok"),
        ("Final score: 12", 0, 10, None, INVALID_VALUE),  # out of range: not clipped to 10
        ("Final score: -1", 0, 10, None, INVALID_VALUE),
        ("Final score: nan", 0, 10, None, NO_VERDICT),
        ("Final score: 0.9\non reflection\nFinal score: 0.2", 0, 1, 0.2, "ok"),  # the last one
        ("Reward: 7", 0, 10, None, NO_VERDICT),
        ("I cannot grade this.", 0, 10, None, NO_VERDICT),
    ],
)
def test_score_table(reply, low, high, value, kind):
    parsed = parse_score(reply, low, high)
    assert parsed.kind == kind
    assert parsed.value == (pytest.approx(value) if value is not None else None)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1, 1, -1], 1.0),  # majority
        ([1, -1], 0.0),  # tie: mean of tied values (1 + -1) / 2
        ([1, 0], 0.5),  # tie: (1 + 0) / 2
        ([0, 1, -1], 0.0),  # three-way tie: (0 + 1 - 1) / 3
        ([-1, -1, 0, 0, 1], -0.5),  # tie of the two most common: (-1 + 0) / 2
        ([0], 0.0),  # a real 0 verdict is a 0
        ([], None),  # no valid vote: unjudged, not 0
    ],
)
def test_majority(values, expected):
    assert majority(values) == expected


def test_mean_uses_only_valid_votes_and_all_invalid_is_missing():
    # BUG-20: ["Reward: 7", "garbage", "Reward: 9"] -> (7 + 9) / 2 = 8.0 with n_valid = 2
    votes = [parse_score(r, 0, 10) for r in ("Final score: 7", "garbage", "Final score: 9")]
    assert mean([v.value for v in votes if v.value is not None]) == 8.0
    assert mean([]) is None


def test_agreement():
    assert agreement([1, 1, -1]) == pytest.approx(2 / 3)
    assert agreement([0, 0]) == 1.0
    assert agreement([]) is None
