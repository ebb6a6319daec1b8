"""Prefill scorer against a fake SGLang engine (httpx.MockTransport) that follows SGLang's
input-logprob layout: with L = logprob_start_len, row 0 is [null, ids[L]] and row k is
[logprob of ids[L + k], ids[L + k]]."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from flywheel.core.errors import ContractError, InvalidRequestError, UpstreamError
from flywheel.teacher.scoring import TeacherScorer, scoring_body


def lp(token: int, pos: int) -> float:
    """The fake teacher's logprob of `token` at position `pos` (distinct per token and place)."""
    return -(token % 7 + 1) / 10 - pos / 1000


class FakeEngine:
    def __init__(
        self,
        delay_s: float = 0.0,
        status: list[int] | None = None,
        refuse_token: int | None = None,
        shift: bool = False,
    ):
        self.bodies: list[dict] = []
        self.delay_s = delay_s
        self.status = list(status or [])
        self.refuse_token = refuse_token
        self.shift = shift
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()

    def result(self, ids: list[int], start: int, k: int) -> dict:
        rows = [[None, ids[start], None]]
        rows += [[lp(ids[p], p), ids[p], None] for p in range(start + 1, len(ids))]
        if self.shift:  # an engine that drops the first response row (the off-by-one bug)
            rows = rows[1:] + [[-1.0, 0, None]]
        tops = [None] + [
            [[-0.1 * (j + 1), 100 + j, None] for j in range(k)] for _ in range(start + 1, len(ids))
        ]
        meta = {"input_token_logprobs": rows, "weight_version": "3"}
        if k:
            meta["input_top_logprobs"] = tops
        return {"text": "", "output_ids": [], "meta_info": meta}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay_s)
            if self.status:
                return httpx.Response(self.status.pop(0), json={"error": {"message": "x"}})
            ids_B = body["input_ids"]
            if self.refuse_token is not None and any(self.refuse_token in ids for ids in ids_B):
                return httpx.Response(400, json={"error": {"message": "bad row"}})
            outs = [
                self.result(ids, s, k)
                for ids, s, k in zip(
                    ids_B, body["logprob_start_len"], body["top_logprobs_num"], strict=True
                )
            ]
            return httpx.Response(200, json=outs)
        finally:
            with self.lock:
                self.active -= 1


def scorer(engine: FakeEngine, **kw) -> TeacherScorer:
    kw.setdefault("backoff_s", 0.0)
    return TeacherScorer(["http://teacher:1"], transport=httpx.MockTransport(engine), **kw)


def test_body_is_prefill_only_with_start_at_the_last_prompt_token():
    body = scoring_body([[5, 6, 7]], [[8, 9]], [0])
    assert body["input_ids"] == [[5, 6, 7, 8, 9]]
    assert body["logprob_start_len"] == [2]  # len(prompt) - 1
    assert body["sampling_params"]["max_new_tokens"] == 0
    assert body["return_logprob"] is True


def test_rows_align_to_the_response_including_its_first_token():
    engine = FakeEngine()
    s = scorer(engine)
    try:
        out = s.score([5, 6, 7], [8, 9, 10], top_k=2)
    finally:
        s.close()
    # Response tokens sit at positions 3, 4, 5 of [5, 6, 7, 8, 9, 10]:
    # lp(8, 3) = -(8 % 7 + 1)/10 - 0.003 = -0.203; lp(9, 4) = -0.304; lp(10, 5) = -0.405.
    assert out.logprobs == pytest.approx([-0.203, -0.304, -0.405])
    assert out.topk_ids == [[100, 101]] * 3
    assert out.topk_logprobs == [pytest.approx([-0.1, -0.2])] * 3
    assert out.weight_version == "3"


def test_shifted_rows_are_refused_not_silently_misaligned():
    s = scorer(FakeEngine(shift=True))
    try:
        with pytest.raises(ContractError, match="misaligned"):
            s.score([5, 6, 7], [8, 9, 10])
    finally:
        s.close()


def test_empty_prompt_or_response_is_refused():
    s = scorer(FakeEngine())
    try:
        with pytest.raises(InvalidRequestError):
            s.score([], [1])
        with pytest.raises(InvalidRequestError):
            s.score([1], [])
    finally:
        s.close()


def _concurrent(s: TeacherScorer, n: int) -> list:
    futures = [s.submit([1, 2, 3 + i], [4, 5]) for i in range(n)]
    return [f.result() for f in futures]


def test_concurrent_requests_share_one_generate_call():
    engine = FakeEngine()
    s = scorer(engine, max_batch=4, batch_wait_ms=200)
    try:
        results = _concurrent(s, 4)
    finally:
        s.close()
    assert len(engine.bodies) == 1 and len(engine.bodies[0]["input_ids"]) == 4
    assert [r.logprobs for r in results] == [pytest.approx([lp(4, 3), lp(5, 4)])] * 4


def test_max_batch_one_sends_one_call_per_request():
    engine = FakeEngine()
    s = scorer(engine, max_batch=1)
    try:
        _concurrent(s, 3)
    finally:
        s.close()
    assert [len(b["input_ids"]) for b in engine.bodies] == [1, 1, 1]


@pytest.mark.parametrize("limit", [1, 2])
def test_per_engine_concurrency_limit(limit):
    engine = FakeEngine(delay_s=0.05)
    s = scorer(engine, max_batch=1, max_concurrency=limit)
    try:
        _concurrent(s, 6)
    finally:
        s.close()
    assert engine.max_active == limit


def test_a_bad_request_in_a_batch_fails_alone():
    engine = FakeEngine(refuse_token=99)
    s = scorer(engine, max_batch=3, batch_wait_ms=200)
    try:
        good = s.submit([1, 2], [3])
        bad = s.submit([1, 99], [3])
        with pytest.raises(InvalidRequestError, match="HTTP 400"):
            bad.result()
        assert good.result().logprobs == pytest.approx([lp(3, 2)])
    finally:
        s.close()


def test_5xx_is_retried_then_upstream_error():
    engine = FakeEngine(status=[503])
    s = scorer(engine, max_attempts=3)
    try:
        assert s.score([1, 2], [3]).logprobs == pytest.approx([lp(3, 2)])
        engine.status = [503, 503, 503]
        with pytest.raises(UpstreamError):
            s.score([1, 2], [3])
    finally:
        s.close()
