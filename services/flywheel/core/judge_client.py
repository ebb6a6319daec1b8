"""Clients of one OpenAI-compatible judge endpoint (SGLang, the embedded engine, a hosted API):
POST {base_url}/chat/completions with a model name and an optional bearer key. Shared by the
reward service (its judges, `AsyncJudgeClient`) and the teacher (its hint judge, `JudgeClient`);
each caller passes its own `JudgeMetrics`, so the metrics carry the caller's name
(`flywheel_reward_judge_*`, `flywheel_teacher_judge_*`).

One `vote` = one chat completion parsed by the caller's parser, retried with bounded exponential
backoff and jitter (tenacity) on timeouts, connection errors, 429/5xx, replies that are not chat
completions, and replies that do not parse. A 4xx other than 429 (bad model name, bad key) is not
retried: it will not get better. When the tries are spent the vote is invalid with the kind of
its last failure; the caller never sees an exception and never a 0.

Each client has its own concurrency limit (calls in flight, an asyncio semaphore held only during
the HTTP call, not during backoff) and its own per-call timeout (seconds, the whole call).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import tenacity
from prometheus_client import Counter, Gauge, Histogram

from flywheel.core.retry import jittered_backoff

log = logging.getLogger(__name__)

INFRA_KINDS = ("timeout", "connection", "server_error", "client_error", "bad_response")
"""Failure kinds of the call itself; the others (no_verdict, invalid_value) are the reply's."""


@dataclass(frozen=True)
class Parsed:
    """One parsed judge reply."""

    value: float | None
    """The vote; None = invalid."""
    kind: str
    """"ok" or the parser's failure kind (e.g. "no_verdict", "invalid_value")."""
    detail: str = ""
    """Human-readable reason when invalid."""


@dataclass(frozen=True)
class JudgeMetrics:
    """The judge-call metrics of one service, named `flywheel_<service>_judge_*`.

    Label `judge` is the judge's name ("judge", "step", "rubric", "hint"); `reason` is a
    failure kind (INFRA_KINDS or a parsing kind).
    """

    up: Gauge
    call_seconds: Histogram
    retries: Counter


_METRICS: dict[str, JudgeMetrics] = {}
_METRICS_LOCK = threading.Lock()


def judge_metrics(service: str) -> JudgeMetrics:
    """The judge-call metrics of `service` ("reward", "teacher"), registered once per process.

    flywheel_<service>_judge_up{judge}: 1 after a reply, 0 after an infrastructure failure.
    flywheel_<service>_judge_call_seconds{judge}: seconds per HTTP call (each try).
    flywheel_<service>_judge_retries_total{judge,reason}: tries retried after a failure.
    """
    with _METRICS_LOCK:
        if service not in _METRICS:
            prefix = f"flywheel_{service}_judge"
            _METRICS[service] = JudgeMetrics(
                up=Gauge(
                    f"{prefix}_up",
                    "1 when the judge's last call got a reply (any parse), 0 when it failed on "
                    "infrastructure (timeout, connection, 429/5xx): alert on 0",
                    ["judge"],
                ),
                call_seconds=Histogram(
                    f"{prefix}_call_seconds",
                    "Latency of one judge HTTP call (each try), seconds",
                    ["judge"],
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                ),
                retries=Counter(
                    f"{prefix}_retries_total",
                    "Judge calls retried after a failure",
                    ["judge", "reason"],
                ),
            )
        return _METRICS[service]


class JudgeCallError(Exception):
    """One failed try. `kind` is one of INFRA_KINDS or a parsing kind; `retryable` says whether
    another try may help."""

    def __init__(self, kind: str, detail: str, retryable: bool = True, reply: str = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.retryable = retryable
        self.reply = reply


@dataclass(frozen=True)
class VoteResult:
    value: float | None
    """The parsed vote; None = invalid after every try."""
    kind: str
    """"ok" or the failure kind of the last try."""
    detail: str
    """The judge's reply (tail) when valid; the failure detail otherwise."""
    attempts: int


class AsyncJudgeClient:
    """Calls one endpoint; safe to share between concurrent tasks of one event loop.

    Args:
        base_url: endpoint root including /v1 (e.g. "http://127.0.0.1:30000/v1").
        model: model name sent in each request.
        name: judge name for metrics and logs ("judge", "step", "rubric").
        metrics: the caller's judge metrics (`judge_metrics("reward")`).
        api_key: bearer token; None = no Authorization header.
        timeout_s: seconds per HTTP call (connect + send + whole reply).
        max_concurrency: calls in flight at once on this client.
        max_attempts: tries per vote (1 = no retry).
        backoff_s: first backoff in seconds; doubles per retry, plus jitter in [0, backoff_s],
            capped at 30 x backoff_s.
        temperature, max_tokens: sampling of the judge.
        transport: httpx async transport override (tests).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        metrics: JudgeMetrics,
        name: str = "judge",
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        max_attempts: int = 3,
        backoff_s: float = 0.5,
        temperature: float = 0.7,
        max_tokens: int = 512,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.metrics = metrics
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = name
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.transport = transport
        self._http: dict[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, asyncio.Semaphore]]
        self._http = {}
        self.retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(max_attempts),
            wait=jittered_backoff(backoff_s),
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, JudgeCallError) and exc.retryable
            ),
            before_sleep=self._before_sleep,
            reraise=True,
        )

    def _session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if loop not in self._http:  # clients and semaphores belong to one event loop
            limits = httpx.Limits(max_connections=self.max_concurrency)
            http = httpx.AsyncClient(
                base_url=self.base_url,
                headers=_auth_headers(self.api_key),
                limits=limits,
                timeout=self.timeout_s,
                transport=self.transport,
            )
            self._http[loop] = (http, asyncio.Semaphore(self.max_concurrency))
        return self._http[loop]

    async def vote(self, prompt: str, parse: Callable[[str], Parsed]) -> VoteResult:
        """One vote: complete `prompt`, parse the reply, retrying as described above."""
        attempts = 0
        try:
            async for attempt in self.retrying.copy():
                with attempt:
                    attempts += 1
                    reply = await self.complete(prompt)
                    parsed = parse(reply)
                    if parsed.value is None:
                        raise JudgeCallError(parsed.kind, parsed.detail, reply=reply)
                    return VoteResult(parsed.value, "ok", reply[-1000:], attempts)
        except JudgeCallError as exc:
            tail = f"; reply tail: {exc.reply[-200:]!r}" if exc.reply else ""
            return VoteResult(None, exc.kind, f"{exc.detail}{tail}", attempts)
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def complete(self, prompt: str) -> str:
        """Text of one chat completion (one try).

        Raises:
            JudgeCallError: kinds timeout, connection, server_error (429/5xx), client_error
                (other 4xx, not retryable), bad_response (not a chat completion).
        """
        http, slots = self._session()
        body = _chat_body(self.model, prompt, self.temperature, self.max_tokens)
        async with slots:
            start = time.perf_counter()
            try:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        resp = await http.post("/chat/completions", json=body)
                except (TimeoutError, httpx.TimeoutException) as exc:
                    raise JudgeCallError("timeout", f"no reply in {self.timeout_s:g} s") from exc
                except httpx.TransportError as exc:
                    raise JudgeCallError("connection", f"{type(exc).__name__}: {exc}") from exc
            except BaseException:  # the judge did not answer: down until a call succeeds
                self.metrics.up.labels(self.name).set(0)
                raise
            finally:
                self.metrics.call_seconds.labels(self.name).observe(time.perf_counter() - start)
        return _reply_text(resp, self.metrics, self.name)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        _count_retry(self.metrics, self.name, state)

    async def aclose(self) -> None:
        """Close this loop's HTTP client."""
        loop = asyncio.get_running_loop()
        pair = self._http.pop(loop, None)
        if pair is not None:
            await pair[0].aclose()


def _count_retry(metrics: JudgeMetrics, name: str, state: tenacity.RetryCallState) -> None:
    """Count and log one failed try that is retried (reason: the error's `kind`)."""
    exc = state.outcome.exception() if state.outcome else None
    metrics.retries.labels(name, getattr(exc, "kind", "unknown")).inc()
    log.info("judge %s try %d failed (%s); retrying", name, state.attempt_number, exc)


def _auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header of `api_key`; none when the key is None or empty."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _chat_body(model: str, prompt: str, temperature: float, max_tokens: int) -> dict:
    """The /chat/completions request of one judge call: `prompt` as the only user message."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": temperature,
        "max_tokens": max_tokens,
    }


def _reply_text(resp: httpx.Response, metrics: JudgeMetrics, name: str) -> str:
    """The message text of one judge HTTP reply ("" when its content is not a string); sets
    `up` to 0 on 429/5xx and to 1 on any other status.

    Raises:
        JudgeCallError: server_error (429/5xx), client_error (another non-200 status, not
            retryable), bad_response (not a chat completion).
    """
    if resp.status_code == 429 or resp.status_code >= 500:
        metrics.up.labels(name).set(0)
        raise JudgeCallError("server_error", f"HTTP {resp.status_code}: {resp.text[:200]}")
    metrics.up.labels(name).set(1)
    if resp.status_code != 200:
        raise JudgeCallError(
            "client_error", f"HTTP {resp.status_code}: {resp.text[:200]}", retryable=False
        )
    try:
        content = resp.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise JudgeCallError(
            "bad_response", f"not an OpenAI chat completion: {resp.text[:200]!r}"
        ) from exc
    return content if isinstance(content, str) else ""


class JudgeInfraError(Exception):
    """Sync client: timeout, connection error, 429 or 5xx after every try. `kind` is
    "timeout", "connection" or "server_error" (the retry metric's reason)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class JudgeClient:
    """Blocking client of one endpoint for thread-based callers (the teacher's hint judge).

    `complete(prompt)` returns the reply text, retrying infra failures like AsyncJudgeClient,
    with the same metrics under the caller's `metrics` and judge `name`.

    Raises (from complete):
        JudgeInfraError: timeout, connection error, 429 or 5xx on every try.
        ValueError: another 4xx, or a reply that is not a chat completion.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        metrics: JudgeMetrics,
        name: str = "hint",
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        max_attempts: int = 3,
        backoff_s: float = 0.5,
        temperature: float = 0.7,
        max_tokens: int = 512,
        transport: httpx.BaseTransport | None = None,
    ):
        self.metrics = metrics
        self.name = name
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=_auth_headers(api_key),
            timeout=timeout_s,
            transport=transport,
        )
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self.retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max_attempts),
            wait=jittered_backoff(backoff_s),
            retry=tenacity.retry_if_exception_type(JudgeInfraError),
            before_sleep=self._before_sleep,
            reraise=True,
        )

    def complete(self, prompt: str) -> str:
        """Text of one chat completion, retried on infra errors."""
        return self.retrying(self._complete_once, prompt)

    def _complete_once(self, prompt: str) -> str:
        body = _chat_body(self.model, prompt, self.temperature, self.max_tokens)
        with self.slots:
            start = time.perf_counter()
            try:
                resp = self.http.post("/chat/completions", json=body)
            except httpx.TimeoutException as exc:
                self.metrics.up.labels(self.name).set(0)
                raise JudgeInfraError("timeout", str(exc)) from exc
            except httpx.TransportError as exc:
                self.metrics.up.labels(self.name).set(0)
                raise JudgeInfraError("connection", f"{type(exc).__name__}: {exc}") from exc
            finally:
                self.metrics.call_seconds.labels(self.name).observe(time.perf_counter() - start)
        try:
            return _reply_text(resp, self.metrics, self.name)
        except JudgeCallError as exc:
            if exc.kind == "server_error":
                raise JudgeInfraError(exc.kind, exc.detail) from exc
            raise ValueError(exc.detail) from exc

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        _count_retry(self.metrics, self.name, state)

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()
