"""bench/peers/learning_efficiency.py: the time-to-reward arithmetic and the process-tree RSS
sampler (a real parent and child process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location(
    "learning_efficiency", ROOT / "bench/peers/learning_efficiency.py"
)
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_moving_average_is_shorter_at_the_start():
    # window 5: step 1 = 0 / 1; step 2 = (0 + 1) / 2; step 6 = mean of steps 2..6 = 4 / 5
    assert bench.moving_average([0, 1, 1, 1, 1, 1]) == pytest.approx([0, 0.5, 2 / 3, 0.75, 0.8, 1])
    assert bench.moving_average([0, 1, 1, 1, 1, 0]) == pytest.approx(
        [0, 0.5, 2 / 3, 0.75, 0.8, 0.8]
    )


def test_time_to_reach_is_the_first_step_whose_average_reaches_the_target():
    # averages 0.2, (0.2 + 0.6) / 2 = 0.4, (0.2 + 0.6 + 0.9) / 3 = 0.5667: step 3, at 130 - 100
    rewards, times = [0.2, 0.6, 0.9], [110.0, 120.0, 130.0]
    assert bench.time_to_reach(rewards, times, 100.0, 0.5) == pytest.approx(30.0)
    assert bench.time_to_reach(rewards, times, 100.0, 0.4) == pytest.approx(20.0)  # reached = equal
    assert bench.time_to_reach(rewards, times, 100.0, 0.6) is None


def test_reward_at_is_the_average_of_the_last_step_scored_by_then():
    # steps scored at 10, 20, 30 s; at 25 s the last is step 2: (0.2 + 0.6) / 2 = 0.4
    rewards, seconds = [0.2, 0.6, 0.9], [10.0, 20.0, 30.0]
    assert bench.reward_at(rewards, seconds, 25.0) == pytest.approx(0.4)
    assert bench.reward_at(rewards, seconds, 30.0) == pytest.approx((0.2 + 0.6 + 0.9) / 3)
    assert bench.reward_at(rewards, seconds, 5.0) is None


def test_median_counts_a_side_that_never_reached_as_late():
    assert bench.median([30.0, None, 10.0]) == 30.0  # sorted: 10, 30, inf
    assert bench.median([None, None, 10.0]) is None


def test_flywheel_curve_takes_each_steps_rollout_end(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward_mean": 0.25}\n{"step": 2, "reward_mean": 0.5}\n'
    )
    (tmp_path / "demo_timeline.jsonl").write_text(
        '{"stage": "eval", "step": 0, "start": 1, "end": 5}\n'
        '{"stage": "rollout", "step": 2, "start": 7, "end": 9}\n'
        '{"stage": "rollout", "step": 1, "start": 5, "end": 6}\n'
    )
    assert bench.flywheel_curve(tmp_path) == ([0.25, 0.5], [6.0, 9.0])


def test_peak_rss_sums_the_whole_process_tree():
    # the parent holds about 40 MiB and its child another 80 MiB at the same time: the peak of
    # the tree is above 120 MiB, more than either process alone
    child = "b = bytearray(80 * 2**20); import time; time.sleep(2)"
    parent = (
        "import subprocess, sys; b = bytearray(40 * 2**20); "
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    )
    launched, peak_mib = bench.run_sampled([sys.executable, "-c", parent], interval_s=0.1)
    assert launched > 0
    assert peak_mib > 120


def test_role_peaks_split_the_tree_by_role():
    # the same parent (40 MiB) and child (80 MiB): each role's own peak, and what each held in
    # the sample where the whole tree peaked (their sum is that peak)
    child = "b = bytearray(80 * 2**20); import time; time.sleep(2)"
    parent = (
        "import subprocess, sys; b = bytearray(40 * 2**20); "
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    )
    roots: list[int] = []

    def role_of(process):
        if not roots:
            roots.append(process.pid)  # the first process sampled is the command itself
        return "parent" if process.pid == roots[0] else "child"

    roles = bench.RolePeaks()
    _, peak_mib = bench.run_sampled(
        [sys.executable, "-c", parent], interval_s=0.1, role_of=role_of, role_peaks=roles
    )
    assert roles.peak["parent"] > 40 and roles.peak["child"] > 80
    assert roles.peak["child"] < peak_mib
    assert sum(roles.at_peak.values()) == pytest.approx(peak_mib, rel=1e-6)
