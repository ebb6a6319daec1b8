"""Continuous batching: rows joining a running batch at different steps decode as if alone.

Tolerance: output logprobs within 1e-4 (absolute, nats) of the same request decoded alone.
Batched matrix products sum in a different order than single-row ones; on this tiny fp32 model
the observed difference is ~1e-6, so 1e-4 leaves room without hiding a wrong row or position.
"""

from __future__ import annotations

import threading

import torch
from torch.testing import assert_close

from flywheel.engine.batcher import RunningBatch, decode_batch
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.sequence import Job, Sequence

PROMPTS = [[1, 9038, 2683, 28], [1, 504, 3458, 314, 260, 1789, 253, 2683, 30, 198], [1719], [5, 6]]


def spec(rid: str, ids: list[int], *, logprob_start_len: int = -1, **params) -> RowSpec:
    return RowSpec(rid, None, ids, SamplingParams(**params), True, logprob_start_len, 0, False)


def make_seq(
    runner, ids: list[int], *, seed: int = 0, logprob_start_len: int = -1, **params
) -> Sequence:
    job = Job(spec("r", ids, logprob_start_len=logprob_start_len, **params))
    seq = Sequence(
        job,
        ids,
        max_new_tokens=job.spec.params.max_new_tokens or 0,
        eos_ids=runner.eos_ids,
        generator=torch.Generator().manual_seed(seed),
    )
    seq.start()
    return seq


def alone(runner, ids, **params):
    seq = make_seq(runner, ids, **params)
    decode_batch(runner, [seq])
    return seq


def test_rows_joining_at_different_steps_match_each_row_alone(runner):
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    refs = [alone(runner, ids, **params) for ids in PROMPTS]
    seqs = [make_seq(runner, ids, **params) for ids in PROMPTS]
    batch = RunningBatch(runner)
    batch.add([seqs[0]])  # short prompt first
    for _ in range(3):
        batch.step()
    batch.add([seqs[1], seqs[2]])  # a longer prompt joins: the running cache is padded left
    batch.step()
    batch.add([seqs[3]])
    widths = []
    while len(batch):
        batch.step()
        widths.append(batch.mask.shape[1])
    for seq, ref in zip(seqs, refs, strict=True):
        assert seq.output_ids == ref.output_ids
        assert_close(
            torch.tensor(seq.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4, rtol=0
        )
    # rows that left shrink the cache: the last row alone ends narrower than the widest point
    assert min(widths) < max(widths)


def test_sampled_rows_with_seeds_match_alone_when_joining_late(runner):
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 8, "ignore_eos": True}
    ref = alone(runner, PROMPTS[1], seed=11, **params)
    first = make_seq(runner, PROMPTS[0], seed=3, **params)
    late = make_seq(runner, PROMPTS[1], seed=11, **params)
    batch = RunningBatch(runner)
    batch.add([first])
    batch.step()
    batch.step()
    batch.add([late])
    while len(batch):
        batch.step()
    assert late.output_ids == ref.output_ids
    assert_close(
        torch.tensor(late.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4, rtol=0
    )


def test_prefill_only_rows_never_join_and_aborts_leave_between_steps(runner):
    batch = RunningBatch(runner)
    scoring = make_seq(runner, PROMPTS[1], logprob_start_len=2, max_new_tokens=0)
    running = make_seq(runner, PROMPTS[0], temperature=0, max_new_tokens=20, ignore_eos=True)
    done = batch.add([scoring, running])
    assert done == [scoring] and batch.seqs == [running]
    assert len(scoring.input_logprobs) == len(PROMPTS[1]) - 2
    batch.step()
    running.job.aborted = True
    finished = batch.step()
    assert finished == [running] and len(batch) == 0
    assert running.finish_reason["type"] == "abort"
    assert len(running.output_ids) == 1  # no token sampled after the abort


def test_a_late_request_joins_the_running_batch_in_the_worker(tiny_engine):
    """A short request sent while a long one decodes finishes first: it did not wait for the
    long one's batch to end (static batching would have queued it behind)."""
    started = threading.Event()
    order: list[str] = []
    lock = threading.Lock()

    def listener(_: dict) -> None:
        started.set()

    (long_job,) = tiny_engine.submit(
        [spec("cb-long", PROMPTS[0], temperature=0, max_new_tokens=120, ignore_eos=True)],
        listeners=[listener],
    )
    assert started.wait(30)
    (short_job,) = tiny_engine.submit(
        [spec("cb-short", PROMPTS[1], temperature=0, max_new_tokens=3, ignore_eos=True)]
    )
    for name, job in (("long", long_job), ("short", short_job)):
        job.future.add_done_callback(
            lambda _f, n=name: (lock.acquire(), order.append(n), lock.release())
        )
    short = short_job.future.result(timeout=60)
    long = long_job.future.result(timeout=60)
    assert order == ["short", "long"]
    assert short["meta_info"]["completion_tokens"] == 3
    assert long["meta_info"]["completion_tokens"] == 120
