"""bench/gateway_report.py: per-round route ratios, their median and spread, and the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import gateway_report as report  # noqa: E402  (bench/gateway_report.py)

# Three interleaved rounds at concurrency 16: chat 0.50, 0.60, 0.40 ms per request; Messages
# 0.60, 0.66, 0.60 -> per-round ratios 1.2, 1.1, 1.5 (median 1.2, lowest 1.1, highest 1.5).
ROUNDS = {
    ("gateway", 16): [{"cpu_ms": 0.50}, {"cpu_ms": 0.60}, {"cpu_ms": 0.40}],
    ("messages", 16): [{"cpu_ms": 0.60}, {"cpu_ms": 0.66}, {"cpu_ms": 0.60}],
}


def test_per_round_ratios_pair_each_round_with_its_own_chat_round():
    got = report.per_round(ROUNDS, ("messages", 16), ("gateway", 16))
    assert got == pytest.approx([1.2, 1.1, 1.5])


def test_spread_is_the_median_with_lowest_and_highest():
    assert report.spread([1.2, 1.1, 1.5]) == "x1.20 [x1.10-x1.50]"
    assert report.spread([]) == "n/a"


def test_a_target_that_did_not_run_gives_no_ratios():
    assert report.per_round(ROUNDS, ("responses", 16), ("gateway", 16)) == []


def test_a_round_where_chat_measured_no_cpu_is_left_out():
    rounds = {
        ("gateway", 1): [{"cpu_ms": 0.0}, {"cpu_ms": 0.5}],
        ("messages", 1): [{"cpu_ms": 0.4}, {"cpu_ms": 0.55}],
    }
    assert report.per_round(rounds, ("messages", 1), ("gateway", 1)) == pytest.approx([1.1])


def test_route_table_has_a_row_per_level_with_chat_medians_and_the_ratios_that_ran():
    lines = report.route_table(ROUNDS, (16,))
    assert lines[3] == "| concurrency | chat ms | chat recorded ms | messages |"
    # chat's median of 0.50, 0.60, 0.40 is 0.50; chat recorded did not run: "-"
    assert lines[-1] == "| 16 | 0.500 | - | x1.20 [x1.10-x1.50] |"


def test_aa_lines_print_each_copy_over_its_target_per_round():
    # The copy ran 0.52, 0.50, 0.36 ms where chat ran 0.50, 0.60, 0.40: ratios 1.04, 0.833,
    # 0.90 -> median 0.90, lowest 0.83, highest 1.04.
    rounds = {**ROUNDS, ("gateway#2", 16): [{"cpu_ms": 0.52}, {"cpu_ms": 0.50}, {"cpu_ms": 0.36}]}
    got = report.aa_lines(rounds, ["gateway", "messages", "gateway#2"], (16,))
    assert got[-1] == "  concurrency 16: gateway#2 / gateway x0.90 [x0.83-x1.04]"
    assert report.aa_lines(ROUNDS, ["gateway", "messages"], (16,)) == []  # no copy: no check


def test_a_target_named_twice_gets_a_numbered_copy():
    import gateway as bench  # noqa: PLC0415  (bench/gateway.py)

    assert bench.copies(["gateway", "messages", "gateway", "gateway"]) == [
        "gateway#2",
        "gateway#3",
    ]
    assert bench.base("responses-unstored#2") == "responses-unstored"
    assert bench._body("responses-unstored#2") == bench.UNSTORED_BODY


def test_slices_are_at_least_slice_min_times_the_concurrency():
    import gateway as bench  # noqa: PLC0415  (bench/gateway.py)

    # 600 requests in 2 slices: 300 each; at 64 raised to 16 x 64 = 1024; at 16 to 256 < 300.
    assert bench.slice_sizes(600, 2, 64, 16) == [1024, 1024]
    assert bench.slice_sizes(600, 2, 16, 16) == [300, 300]
    assert bench.slice_sizes(601, 2, 64, 0) == [301, 300]  # 0: the split alone
