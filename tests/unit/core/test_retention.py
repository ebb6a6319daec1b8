"""Retention arithmetic: durations with units, the trim point over groups, the setting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel.core.retention import parse_duration, parse_id, trim_point
from flywheel.core.settings import StreamSettings


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3600", 3600.0),
        (90, 90.0),
        ("90s", 90.0),
        ("15m", 900.0),  # 15 * 60
        ("12h", 43_200.0),  # 12 * 3600
        ("7d", 604_800.0),  # 7 * 86_400
        ("1.5d", 129_600.0),  # 1.5 * 86_400
        ("2w", 1_209_600.0),  # 2 * 604_800
        ("0", 0.0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["7 days", "d7", "-5", "7x", ""])
def test_parse_duration_refuses(bad):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_setting_refused_at_start_and_read_in_seconds():
    assert StreamSettings(retention="12h").retention_s == 43_200.0
    assert StreamSettings().retention_s == 604_800.0  # default 7d
    with pytest.raises(ValidationError, match=r"streams\.retention"):
        StreamSettings(retention="7 days")
    with pytest.raises(ValidationError):
        StreamSettings(retension="7d")  # misspelled field


def test_trim_point_worked_example():
    # retention 3600 s at now = 10_000_000 ms: age cut 10_000_000 - 3_600_000 = 6_400_000-0.
    # reward: delivered up to 6_500_000-0, none pending -> 6_500_000-1.
    # audit: oldest pending 5_000_000-3 -> 5_000_000-3.  min of the three = 5_000_000-3.
    groups = [((6_500_000, 0), None), ((6_600_000, 0), (5_000_000, 3))]
    assert trim_point(groups, 10_000_000, 3_600_000) == (5_000_000, 3)


def test_trim_point_age_bounds_it():
    # every group is done with everything up to 9_000_000-0, but the age cut is 6_400_000-0
    groups = [((9_000_000, 0), None)]
    assert trim_point(groups, 10_000_000, 3_600_000) == (6_400_000, 0)


def test_trim_point_undelivered_entries_stay():
    # a group that has read nothing (last delivered 0-0): point 0-1, nothing goes
    assert trim_point([((9_000_000, 0), None), ((0, 0), None)], 10_000_000, 0) == (0, 1)


def test_no_groups_keeps_everything():
    assert trim_point([], 10_000_000, 0) is None


def test_parse_id():
    assert parse_id(b"1700000000000-7") == (1_700_000_000_000, 7)
    assert parse_id("5") == (5, 0)
