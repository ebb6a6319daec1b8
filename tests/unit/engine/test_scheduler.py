"""Batch collection order, controls as barriers, pausing (no model needed)."""

from __future__ import annotations

from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.scheduler import Control, WorkQueue
from flywheel.engine.sequence import Job


def job(rid: str) -> Job:
    return Job(RowSpec(rid, None, [1], SamplingParams(), False, -1, 0, False))


def test_jobs_before_a_control_run_first_and_the_control_ends_the_batch():
    q = WorkQueue()
    a, b, c = job("a"), job("b"), job("c")
    ctl = Control(lambda: "swapped")
    for item in (a, b, ctl, c):
        q.put(item)
    jobs, controls = q.next_batch(max_size=8, wait_s=0.0)
    assert jobs == [a, b] and controls == [ctl]
    jobs, controls = q.next_batch(max_size=8, wait_s=0.0)
    assert jobs == [c] and controls == []


def test_max_batch_size_splits_the_queue():
    q = WorkQueue()
    all_jobs = [job(str(i)) for i in range(5)]
    for j in all_jobs:
        q.put(j)
    assert q.next_batch(max_size=3, wait_s=0.0)[0] == all_jobs[:3]
    assert q.next_batch(max_size=3, wait_s=0.0)[0] == all_jobs[3:]
    assert q.next_batch(max_size=3, wait_s=0.0) == ([], [])


def test_paused_queue_holds_jobs_runs_controls_and_releases_aborted_jobs():
    q = WorkQueue()
    q.paused.set()
    a, b = job("a"), job("b")
    ctl = Control(lambda: None)
    for item in (a, b, ctl):
        q.put(item)
    assert q.next_batch(8, 0.0) == ([], [])  # a held
    assert q.next_batch(8, 0.0) == ([], [])  # b held
    assert q.next_batch(8, 0.0) == ([], [ctl])
    b.aborted = True
    assert q.next_batch(8, 0.0) == ([b], [])
    q.paused.clear()
    assert q.next_batch(8, 0.0) == ([a], [])


def test_control_reports_its_exception():
    def boom() -> None:
        raise ValueError("bad")

    ctl = Control(boom)
    ctl.run()
    assert isinstance(ctl.future.exception(), ValueError)
