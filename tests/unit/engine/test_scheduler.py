"""Admission order, draining vs urgent controls, pausing (no model needed)."""

from __future__ import annotations

from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.scheduler import Control, WorkQueue
from flywheel.engine.sequence import Job


def job(rid: str) -> Job:
    return Job(RowSpec(rid, None, [1], SamplingParams(), False, -1, 0, False))


def test_a_draining_control_waits_for_earlier_rows_and_holds_later_ones():
    q = WorkQueue()
    a, b, c = job("a"), job("b"), job("c")
    swap = Control(lambda: "swapped", drain=True)
    for item in (a, b, swap, c):
        q.put(item)
    q.pull()
    assert q.admit(room=8, running=0) == ([], [a, b])
    # a and b still decoding: the swap waits, and c (behind it) is not admitted
    assert q.admit(room=6, running=2) == ([], [])
    # a and b done: the swap runs, then c joins in the same round (after the swap)
    assert q.admit(room=8, running=0) == ([swap], [c])


def test_urgent_controls_skip_the_line():
    q = WorkQueue()
    a = job("a")
    barrier = Control(lambda: None)
    q.put(a)
    q.put(barrier)
    q.pull()
    assert list(q.urgent) == [barrier] and list(q.waiting) == [a]


def test_room_limits_admission_and_the_rest_joins_later():
    q = WorkQueue()
    jobs = [job(str(i)) for i in range(5)]
    for j in jobs:
        q.put(j)
    q.pull()
    assert q.admit(room=3, running=0)[1] == jobs[:3]
    assert q.admit(room=0, running=3)[1] == []
    assert q.admit(room=1, running=2)[1] == jobs[3:4]  # a late row joins a running batch
    assert q.admit(room=8, running=3)[1] == jobs[4:]
    assert q.admit(room=8, running=0) == ([], [])


def test_paused_queue_holds_jobs_runs_draining_controls_and_releases_aborted_jobs():
    q = WorkQueue()
    q.paused.set()
    a, b = job("a"), job("b")
    swap = Control(lambda: None, drain=True)
    for item in (a, b, swap):
        q.put(item)
    q.pull()
    assert q.admit(8, running=2) == ([swap], [])  # paused: the swap runs at once
    assert q.admit(8, running=0) == ([], [])  # jobs held
    b.aborted = True
    assert q.take_aborted() == [b]
    q.paused.clear()
    assert q.admit(8, running=0) == ([], [a])


def test_pull_lingers_for_requests_sent_together():
    q = WorkQueue()
    q.put(job("a"))
    q.pull(block_s=0.1, linger_s=0.0)
    assert len(q.waiting) == 1


def test_control_reports_its_exception():
    def boom() -> None:
        raise ValueError("bad")

    ctl = Control(boom)
    ctl.run()
    assert isinstance(ctl.future.exception(), ValueError)
