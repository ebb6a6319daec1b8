"""The demo's pacing: rollouts of step s begin once the engine serves weight version
s - 1 - max_staleness (async), or s - 1 (sync = max_staleness 0). Checked with a fake
trainer/engine (no processes): the order of recorded events, not timing."""

from __future__ import annotations

import json
import threading

import pytest

from flywheel.ops.demo.plot import parse_event
from flywheel.ops.demo.runner import DemoConfig, DemoRunner, may_start, min_version_to_start


@pytest.mark.parametrize(
    ("step", "version", "max_staleness", "allowed"),
    [
        # max_staleness 1: steps 1 and 2 start on the initial weights, step 3 needs version 1
        (1, 0, 1, True),
        (2, 0, 1, True),
        (3, 0, 1, False),
        (3, 1, 1, True),
        (4, 1, 1, False),
        (4, 2, 1, True),
        # max_staleness 0 is sync: step s needs version s - 1
        (1, 0, 0, True),
        (2, 0, 0, False),
        (2, 1, 0, True),
        (5, 3, 0, False),
        (5, 4, 0, True),
        # max_staleness 2: three steps on the initial weights
        (3, 0, 2, True),
        (4, 0, 2, False),
        (4, 1, 2, True),
        # a newer version than needed never blocks
        (2, 7, 0, True),
    ],
)
def test_may_start_worked_examples(step, version, max_staleness, allowed):
    assert may_start(step, version, max_staleness) is allowed


def test_min_version_to_start_is_step_minus_one_minus_staleness():
    assert [min_version_to_start(s, 1) for s in range(1, 6)] == [-1, 0, 1, 2, 3]
    assert [min_version_to_start(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
def test_max_staleness_zero_is_sync_and_each_step_needs_exactly_its_minimum(max_staleness):
    for step in range(1, 20):
        need = min_version_to_start(step, max_staleness)
        assert may_start(step, need, max_staleness)
        assert not may_start(step, need - 1, max_staleness)
        if max_staleness == 0:
            assert need == step - 1  # sync: the previous step's weights


class FakeStack:
    """A fake trainer and engine. The trainer makes version v + 1 once the episodes of steps
    1..v + 1 have finished and the engine has been asked for its version `polls_per_step` more
    times (training "takes" that many polls). Every event is appended to `log` in order."""

    def __init__(self, per_step: int, polls_per_step: int = 3):
        self.per_step = per_step
        self.polls_per_step = polls_per_step
        self.lock = threading.Lock()
        self.finished = 0
        self.version = 0
        self.progress = 0
        self.log: list[tuple[str, int]] = []

    def episode(self, problem, group_id, *, evaluation, temperature):  # noqa: ANN001
        if not evaluation:
            with self.lock:
                self.finished += 1
        return 1.0 if problem.answer % 2 == 0 else 0.0

    def engine_version(self) -> int:
        with self.lock:
            if self.finished >= (self.version + 1) * self.per_step:
                self.progress += 1
                if self.progress >= self.polls_per_step:
                    self.version += 1
                    self.progress = 0
                    self.log.append(("served", self.version))
            return self.version


def _run(tmp_path, mode: str, max_staleness: int = 1, steps: int = 4):
    cfg = DemoConfig(
        steps=steps,
        problems_per_step=2,
        group_size=2,
        mode=mode,
        max_staleness=max_staleness,
        poll_s=0.0,
        step_timeout_s=30.0,
    )
    lines: list[str] = []
    runner = DemoRunner(
        "http://gateway.invalid", "http://engine.invalid", cfg, tmp_path, lines.append
    )
    fake = FakeStack(per_step=cfg.problems_per_step * cfg.group_size)
    runner.episode = fake.episode  # type: ignore[method-assign]
    runner.engine_version = fake.engine_version  # type: ignore[method-assign]
    rollouts = runner.rollouts
    started = iter(range(1, steps + 1))

    def recorded_rollouts(problems):  # noqa: ANN001, ANN202
        step = next(started)
        fake.log.append(("rollout", step))
        return rollouts(problems)

    runner.rollouts = recorded_rollouts  # type: ignore[method-assign]
    summary = runner.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return fake.log, rows, summary, lines


def _served_before(log, step: int) -> int:
    """The newest version served before rollouts of `step` began."""
    served = 0
    for kind, value in log:
        if kind == "rollout" and value == step:
            return served
        if kind == "served":
            served = value
    raise AssertionError(f"no rollouts of step {step} in {log}")


def test_async_rollouts_of_step_2_begin_before_version_1_is_served(tmp_path):
    log, rows, summary, _ = _run(tmp_path, "async", max_staleness=1)
    assert log.index(("rollout", 2)) < log.index(("served", 1))
    # ...but never more than max_staleness steps ahead of the served weights
    for step in range(1, 5):
        assert _served_before(log, step) >= step - 1 - 1
    assert log.index(("served", 1)) < log.index(("rollout", 3))
    assert [r["engine_version"] for r in rows][:2] == [0, 0]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
    # the after-training evaluation waits for the final version
    assert ("served", 4) in log and summary["steps"] == 4


def test_sync_rollouts_of_step_2_begin_only_after_version_1_is_served(tmp_path):
    log, rows, _, _ = _run(tmp_path, "sync", max_staleness=1)  # sync ignores max_staleness
    assert log.index(("served", 1)) < log.index(("rollout", 2))
    for step in range(1, 5):
        assert _served_before(log, step) == step - 1
    assert [r["engine_version"] for r in rows] == [0, 1, 2, 3]


def test_async_with_max_staleness_zero_orders_events_like_sync(tmp_path):
    async_log, _, _, _ = _run(tmp_path / "a", "async", max_staleness=0)
    sync_log, _, _, _ = _run(tmp_path / "s", "sync")
    assert async_log == sync_log


def test_a_run_keeps_the_metrics_and_summary_formats_and_records_its_timeline(tmp_path):
    _, rows, summary, lines = _run(tmp_path, "async")
    assert set(rows[0]) >= {"step", "reward_mean", "weight_version", "engine_version", "seconds"}
    assert [r["samples"] for r in rows] == [4, 4, 4, 4]
    assert lines[-1].startswith("reward first5=") and " steps=4 minutes=" in lines[-1]
    events = [
        parse_event(line) for line in (tmp_path / "demo_timeline.jsonl").read_text().splitlines()
    ]
    assert all(e is not None and e.process == "demo" for e in events)
    assert [(e.stage, e.step) for e in events] == [  # type: ignore[union-attr]
        ("eval", 0),
        ("rollout", 1),
        ("rollout", 2),
        ("rollout", 3),
        ("rollout", 4),
        ("eval", 4),
    ]
    png = (tmp_path / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


def test_the_trainers_timeline_is_drawn_and_its_malformed_lines_are_reported(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    good = {"process": "trainer", "stage": "train", "step": 1, "start": 1e12, "end": 1e12 + 1}
    (tmp_path / "timeline.jsonl").write_text(json.dumps(good) + "\n{truncated\n")
    _, _, _, lines = _run(tmp_path, "async")
    assert any("skipped 1 malformed line(s)" in line for line in lines)
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_run_under_10_steps_reports_no_reward_windows(tmp_path):
    """first5 and last5 of 4 steps would share 4 of their 5 steps: null in summary.json and n/a
    in the summary line, as the README says (a short run reports held-out accuracy only)."""
    _, rows, summary, lines = _run(tmp_path, "async", steps=9)
    assert len(rows) == 9
    assert summary["first5"] is None and summary["last5"] is None
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["first5"] is None and saved["last5"] is None
    assert lines[-1].startswith("reward first5=n/a last5=n/a eval_before="), lines[-1]


def test_a_run_of_10_steps_compares_two_windows_with_no_step_in_common(tmp_path):
    _, rows, summary, _ = _run(tmp_path, "async", steps=10)
    rewards = [r["reward_mean"] for r in rows]
    assert summary["first5"] == pytest.approx(sum(rewards[:5]) / 5)
    assert summary["last5"] == pytest.approx(sum(rewards[5:]) / 5)
