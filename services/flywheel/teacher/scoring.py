"""Teacher logprobs by prefill-only scoring on SGLang-protocol engines, with request batching.

One request = (teacher prompt ids P, student response ids R, top-k). On the engine it becomes
`input_ids = P + R`, `sampling_params.max_new_tokens = 0` (prefill only), `return_logprob`,
`logprob_start_len = len(P) - 1`. SGLang then returns `len(R) + 1` rows of
`meta_info.input_token_logprobs`: row 0 is `[null, P[-1], ...]` and row i + 1 is
`[log p(R[i] | P, R[:i]), R[i], ...]`, so the rows align to R after dropping row 0, and the first
response token keeps its logprob (with `logprob_start_len = len(P)` it would be the null row:
the off-by-one this layout avoids). Every returned row's id is checked against R; a mismatch is a
`ContractError`, never a silently shifted array. `top_logprobs_num: k` gives
`input_top_logprobs` aligned the same way.

Temperature: input logprobs are log_softmax(logits) at temperature 1 on SGLang and on the
embedded engine (temperature in sampling_params does not change them).

Batching: concurrent `submit` calls are coalesced, up to `max_batch` requests or `batch_wait_ms`
after the first, into one /generate call with list-valued `input_ids`, `logprob_start_len` and
`top_logprobs_num`. At most `max_concurrency` calls are in flight per engine; a batch goes to the
engine with the fewest calls in flight. A 400 on a batch of several requests is retried request by
request, so one bad request fails alone. Transport errors, 429 and 5xx are retried with
exponential backoff, then raise `UpstreamError`.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import tenacity

from flywheel.core.errors import ContractError, InvalidRequestError, UpstreamError
from flywheel.core.retry import jittered_backoff
from flywheel.teacher import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoredTokens:
    """Teacher logprobs of one response; all lists have len(response_ids) entries."""

    logprobs: list[float]
    """log p_teacher(R[i] | P, R[:i]) at temperature 1; NaN where the engine returned null."""
    topk_ids: list[list[int]]
    """Per response token, the teacher's top-k ids (empty lists when k = 0)."""
    topk_logprobs: list[list[float]]
    weight_version: str
    """The teacher engine's weight version when it scored (SGLang meta_info.weight_version)."""
    engine_url: str


@dataclass
class _Job:
    prompt_ids: list[int]
    response_ids: list[int]
    top_k: int
    future: Future = field(default_factory=Future)


class _Retryable(Exception):
    pass


@dataclass
class _Engine:
    url: str
    in_flight: int = 0


def scoring_body(
    prompts: list[list[int]], responses: list[list[int]], top_ks: list[int]
) -> dict[str, Any]:
    """The /generate body that scores each response after its prompt (lists, one per request).

    Raises:
        InvalidRequestError: an empty prompt or response.
    """
    for p, r in zip(prompts, responses, strict=True):
        if not p or not r:
            raise InvalidRequestError("teacher scoring needs a non-empty prompt and response")
    return {
        "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": [len(p) - 1 for p in prompts],
        "top_logprobs_num": list(top_ks),
    }


def parse_scored(
    out: dict[str, Any], response_ids: list[int], top_k: int, url: str
) -> ScoredTokens:
    """Response rows of one /generate result, aligned to `response_ids` (row 0 dropped).

    Raises:
        ContractError: the rows do not echo `response_ids` one for one.
    """
    meta = out.get("meta_info") or {}
    rows = meta.get("input_token_logprobs") or []
    if len(rows) != len(response_ids) + 1:
        raise ContractError(
            f"teacher engine {url} returned {len(rows)} input logprob rows for "
            f"{len(response_ids)} response tokens (expected {len(response_ids)}"
            " + 1); it does not implement logprob_start_len like SGLang"
        )
    got = [int(row[1]) for row in rows[1:]]
    if got != response_ids:
        first = next(i for i, (a, b) in enumerate(zip(got, response_ids, strict=True)) if a != b)
        raise ContractError(
            f"teacher engine {url} rows are misaligned: row {first + 1} scores "
            f"id {got[first]}, the response has {response_ids[first]}"
        )
    logprobs = [math.nan if row[0] is None else float(row[0]) for row in rows[1:]]
    ids: list[list[int]] = [[] for _ in response_ids]
    lps: list[list[float]] = [[] for _ in response_ids]
    if top_k:
        tops = (meta.get("input_top_logprobs") or [])[1:]
        if len(tops) != len(response_ids):
            raise ContractError(
                f"teacher engine {url} returned {len(tops)} top-k rows for "
                f"{len(response_ids)} response tokens"
            )
        for i, top in enumerate(tops):
            entries = list(top or [])[:top_k]
            ids[i] = [int(e[1]) for e in entries]
            lps[i] = [-math.inf if e[0] is None else float(e[0]) for e in entries]
    return ScoredTokens(logprobs, ids, lps, str(meta.get("weight_version", "")), url)


class TeacherScorer:
    """Scores responses on one or more teacher engines; thread-safe.

    Args:
        engine_urls: SGLang-protocol engine roots (e.g. "http://127.0.0.1:30100").
        max_batch: requests per /generate call; 1 = one by one.
        batch_wait_ms: milliseconds to wait for more requests after the first of a batch.
        max_concurrency: /generate calls in flight per engine.
        timeout_s: seconds per /generate call.
        max_attempts: tries per call on transport errors, 429 and 5xx.
        backoff_s: first retry backoff in seconds (doubling, with jitter).
        transport: httpx transport override (unit tests).
    """

    def __init__(
        self,
        engine_urls: list[str],
        *,
        max_batch: int = 16,
        batch_wait_ms: float = 10.0,
        max_concurrency: int = 2,
        timeout_s: float = 120.0,
        max_attempts: int = 3,
        backoff_s: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ):
        if not engine_urls:
            raise InvalidRequestError("the teacher needs at least one engine URL")
        self.engines = [_Engine(u.rstrip("/")) for u in engine_urls]
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_ms / 1000
        self.max_concurrency = max_concurrency
        self.http = httpx.Client(timeout=timeout_s, transport=transport)
        self.retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max_attempts),
            wait=jittered_backoff(backoff_s),
            retry=tenacity.retry_if_exception_type(_Retryable),
            reraise=True,
        )
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.slots = threading.Condition()
        self.pool = ThreadPoolExecutor(
            max_workers=max_concurrency * len(self.engines), thread_name_prefix="teacher-score"
        )
        self.calls = itertools.count()
        self.dispatcher = threading.Thread(
            target=self._dispatch, name="teacher-batcher", daemon=True
        )
        self.dispatcher.start()

    def submit(self, prompt_ids: list[int], response_ids: list[int], top_k: int = 0) -> Future:
        """Queue one request; the Future resolves to `ScoredTokens` or raises (see `score`)."""
        job = _Job(list(prompt_ids), list(response_ids), top_k)
        if not job.prompt_ids or not job.response_ids:
            job.future.set_exception(
                InvalidRequestError("teacher scoring needs a non-empty prompt and response")
            )
            return job.future
        self.queue.put(job)
        return job.future

    def score(self, prompt_ids: list[int], response_ids: list[int], top_k: int = 0) -> ScoredTokens:
        """Teacher logprobs of `response_ids` after `prompt_ids` (blocking).

        Raises:
            InvalidRequestError: empty prompt/response, or the engine refused the request (400).
            ContractError: the engine's rows do not align with `response_ids`.
            UpstreamError: the engine failed after retries.
        """
        return self.submit(prompt_ids, response_ids, top_k).result()

    def close(self) -> None:
        self.queue.put(None)
        self.dispatcher.join(timeout=5)
        self.pool.shutdown(wait=True)
        self.http.close()

    # -- batching -----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            batch = [job]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    if remaining > 0:
                        nxt = self.queue.get(timeout=remaining)
                    else:
                        nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)
                    break
                batch.append(nxt)
            engine = self._acquire()
            self.pool.submit(self._run, engine, batch)

    def _acquire(self) -> _Engine:
        with self.slots:
            while True:
                free = [e for e in self.engines if e.in_flight < self.max_concurrency]
                if free:
                    engine = min(free, key=lambda e: e.in_flight)
                    engine.in_flight += 1
                    return engine
                self.slots.wait()

    def _release(self, engine: _Engine) -> None:
        with self.slots:
            engine.in_flight -= 1
            self.slots.notify()

    def _run(self, engine: _Engine, batch: list[_Job]) -> None:
        try:
            try:
                results = self._call(engine, batch)
            except InvalidRequestError:
                if len(batch) == 1:
                    raise
                results = []
                for job in batch:  # one bad request must not fail the others
                    try:
                        results.append(self._call(engine, [job])[0])
                    except Exception as exc:  # noqa: BLE001  (delivered to its own caller)
                        results.append(exc)
            for job, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)
        except Exception as exc:  # noqa: BLE001  (delivered to every caller of the batch)
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
        finally:
            self._release(engine)

    def _call(self, engine: _Engine, batch: list[_Job]) -> list[ScoredTokens | Exception]:
        body = scoring_body(
            [j.prompt_ids for j in batch], [j.response_ids for j in batch], [j.top_k for j in batch]
        )
        metrics.BATCH_SIZE.observe(len(batch))
        start = time.monotonic()
        try:
            outs = self.retrying(self._post, engine.url, body)
        except _Retryable as exc:
            raise UpstreamError(f"teacher engine {engine.url} failed: {exc}") from exc
        metrics.SCORE_SECONDS.observe(time.monotonic() - start)
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(batch):
            raise ContractError(
                f"teacher engine {engine.url} answered {len(outs)} results for "
                f"a batch of {len(batch)}"
            )
        results: list[ScoredTokens | Exception] = []
        for job, out in zip(batch, outs, strict=True):
            try:
                results.append(parse_scored(out, job.response_ids, job.top_k, engine.url))
            except ContractError as exc:
                results.append(exc)
        return results

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        try:
            resp = self.http.post(f"{url}/generate", json=body)
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code != 200:
            raise InvalidRequestError(
                f"teacher engine {url} refused the scoring request "
                f"(HTTP {resp.status_code}): {resp.text[:300]}"
            )
        return resp.json()
