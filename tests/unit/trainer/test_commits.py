"""The commit log: durable per-step records, torn lines, truncation after a checkpoint, and the
RNG states a step is trained again from."""

from __future__ import annotations

import random

import torch

from flywheel.trainer.commits import (
    CommitLog,
    CommitRecord,
    GroupRecord,
    capture_rng,
    restore_rng,
)


def _record(step: int, ids: list[str]) -> CommitRecord:
    group = GroupRecord(f"g{step}", ids, [("fresh", 1.0)] * (len(ids) - 1) + [("downweight", 0.5)])
    return CommitRecord(step, [group], [f"s-{i}" for i in ids], {})


def test_records_round_trip_in_order(tmp_path):
    log = CommitLog(tmp_path)
    log.append(_record(1, ["1-0", "2-0"]))
    log.append(_record(2, ["3-0"]))
    (first, second) = log.records()
    assert first.step == 1 and first.entry_ids == ["1-0", "2-0"]
    assert first.groups[0].treatments == [("fresh", 1.0), ("downweight", 0.5)]
    assert second.sample_ids == ["s-3-0"]


def test_after_keeps_the_last_record_of_a_step_trained_again(tmp_path):
    log = CommitLog(tmp_path)
    for step, ids in ((1, ["1-0"]), (2, ["2-0"]), (3, ["3-0"]), (2, ["2-0", "9-0"])):
        log.append(_record(step, ids))
    # after checkpoint 1: steps 2 and 3, step 2 as recorded last
    assert [(r.step, r.entry_ids) for r in log.after(1)] == [(2, ["2-0", "9-0"]), (3, ["3-0"])]


def test_a_torn_last_line_is_not_a_commit(tmp_path):
    log = CommitLog(tmp_path)
    log.append(_record(1, ["1-0"]))
    with log.path.open("a") as f:
        f.write('{"step": 2, "groups": [{"group_id"')  # killed mid-write
    assert [r.step for r in log.records()] == [1]


def test_truncate_keeps_only_steps_after_the_checkpoint(tmp_path):
    log = CommitLog(tmp_path)
    for step in range(1, 6):
        log.append(_record(step, [f"{step}-0"]))
    log.truncate(3)
    assert [r.step for r in log.records()] == [4, 5]
    log.append(_record(6, ["6-0"]))
    assert [r.step for r in log.after(0)] == [4, 5, 6]


def test_restored_rng_draws_the_same_numbers():
    state = capture_rng()
    a = (torch.rand(3), random.random())
    torch.rand(5)
    restore_rng(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    line = CommitRecord(1, [], [], state).to_json()  # survives the JSON line
    restore_rng(CommitRecord.from_json(line).rng)
    assert torch.equal(torch.rand(3), a[0]) and random.random() == a[1]
