"""Checkpoint writes and weight pushes in background threads: ordering, coalescing, errors
handed back, and the synchronous mode."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from flywheel.core.errors import UpstreamError
from flywheel.trainer.background import BackgroundPusher, CheckpointJob, CheckpointWriter
from flywheel.trainer.snapshots import cpu_snapshot
from flywheel.trainer.weights import PushReport


def _job(step: int) -> CheckpointJob:
    return CheckpointJob(step, None, None, {}, [f"{step}-0"])


def test_a_checkpoint_is_written_while_the_caller_goes_on():
    release = threading.Event()
    written: list[int] = []

    def save(job: CheckpointJob) -> Path:
        release.wait(5)
        written.append(job.step)
        return Path(f"/ckpt/{job.step}")

    writer = CheckpointWriter(save)
    writer.submit(_job(3))
    assert writer.busy and writer.finished() == []  # the caller was not held
    release.set()
    writer.wait()
    (done,) = writer.finished()
    assert done.step == 3 and done.path == Path("/ckpt/3") and done.end >= done.start
    assert written == [3]


def test_the_next_checkpoint_waits_for_the_previous_one():
    order: list[str] = []

    def save(job: CheckpointJob) -> Path:
        order.append(f"start {job.step}")
        order.append(f"end {job.step}")
        return Path(".")

    writer = CheckpointWriter(save)
    writer.submit(_job(1))
    writer.submit(_job(2))
    writer.wait()
    assert order == ["start 1", "end 1", "start 2", "end 2"]
    assert [j.step for j in writer.finished()] == [1, 2]


def test_a_failed_checkpoint_is_handed_back_not_lost():
    def save(job: CheckpointJob) -> Path:
        raise OSError("disk full")

    writer = CheckpointWriter(save)
    writer.submit(_job(1))
    writer.wait()
    (job,) = writer.finished()
    assert isinstance(job.error, OSError) and job.path is None


def test_pushes_run_one_at_a_time_and_skip_a_version_overtaken_while_waiting():
    gate, loading = threading.Event(), threading.Event()
    pushed: list[int] = []

    def write(version, snapshot):
        return Path(f"/w/{version}")

    def push(path, version):
        if version == 1:
            loading.set()
            gate.wait(5)  # version 1 is loading while 2 and 3 arrive
        pushed.append(version)
        return PushReport(version, ["e"], {}, 0.0)

    pusher = BackgroundPusher(write, push)
    pusher.offer(1, {})
    assert loading.wait(5)
    pusher.offer(2, {})
    pusher.offer(3, {})
    gate.set()
    assert pusher.wait(5)
    outcomes = pusher.results()
    assert pushed == [1, 3]  # never 2 after 3, never two at once
    assert [(o.version, o.coalesced) for o in outcomes] == [(2, True), (1, False), (3, False)]
    pusher.close()


def test_a_push_that_failed_everywhere_is_handed_back(tmp_path):
    def push(path, version):
        raise UpstreamError("no engine took it")

    pusher = BackgroundPusher(lambda v, s: tmp_path, push)
    pusher.offer(4, {})
    pusher.wait(5)
    (outcome,) = pusher.results()
    assert isinstance(outcome.error, UpstreamError) and outcome.version == 4
    pusher.close()


def test_disabled_runs_in_the_calling_thread(tmp_path):
    threads: list[str] = []

    def push(path, version):
        threads.append(threading.current_thread().name)
        return PushReport(version, [], {}, 0.0)

    BackgroundPusher(lambda v, s: tmp_path, push, enabled=False).offer(1, {})
    assert threads == [threading.current_thread().name]


def test_a_push_reports_the_bytes_it_wrote_before_the_folder_can_be_pruned(tmp_path):
    def write(version, snapshot):
        folder = tmp_path / f"v_{version}"
        (folder / "sub").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
        (folder / "sub" / "config.json").write_bytes(b"{}")
        return folder

    def push(path, version):
        shutil.rmtree(path)  # pruned right after the load: the size was taken before
        return PushReport(version, ["e"], {}, 0.0)

    pusher = BackgroundPusher(write, push, enabled=False)
    pusher.offer(7, {})
    (outcome,) = pusher.results()
    assert (outcome.version, outcome.bytes) == (7, 1000 + 2)  # both files, nested too
    assert outcome.end >= outcome.start > 0


def test_a_snapshot_does_not_follow_later_updates_and_keeps_ties():
    weight = torch.nn.Parameter(torch.ones(2, 3))
    state = {"embed.weight": weight, "lm_head.weight": weight, "bias": torch.zeros(3)}
    snap = cpu_snapshot(state, torch.bfloat16)
    with torch.no_grad():
        weight.add_(1.0)
    assert torch.equal(snap["embed.weight"], torch.ones(2, 3, dtype=torch.bfloat16))
    assert snap["embed.weight"].data_ptr() == snap["lm_head.weight"].data_ptr()
    assert snap["bias"].dtype == torch.bfloat16


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpoint_writer_modes_give_the_same_results(enabled):
    writer = CheckpointWriter(lambda job: Path(str(job.step)), enabled=enabled)
    writer.submit(_job(7))
    writer.wait()
    assert [j.path for j in writer.finished()] == [Path("7")]
