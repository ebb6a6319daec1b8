"""The engine's single worker thread: it owns the model and runs the continuous batch.

HTTP handlers never touch the model. They `submit()` rows (each gets a Future), `abort()` rows
by rid prefix, pause/continue, or hand weight swaps over as control items. Loop, once per decode
step: pull new items from the inbox; finish rows aborted meanwhile; run urgent controls; ask
`scheduler.WorkQueue.admit()` for the controls and jobs that may start now; prefill admitted
jobs and merge them into the `batcher.RunningBatch`; then one decode step for every running row.
Rows finish (and their futures resolve) the step they stop, not when the batch ends.

Weight swaps (`engine.weight_swap = "step"`, the default) are urgent controls: they run at the
next step boundary, the running rows' next-token logits are recomputed under the new weights,
and the rows continue; `meta_info.weight_versions` records the spans, as SGLang does. With
`"drain"` they are draining controls: rows that arrived before the swap finish on the old
weights, rows after it start on the new ones (one version per row unless paused in place).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flywheel.core.errors import InvalidRequestError, OverloadedError, PlatformError
from flywheel.core.settings import EngineSettings
from flywheel.engine.batcher import RunningBatch
from flywheel.engine.context import check_context_length
from flywheel.engine.grammar import GrammarCompiler
from flywheel.engine.metrics import EngineMetrics
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.runner import ModelRunner
from flywheel.engine.scheduler import POLL_S, Control, WorkQueue
from flywheel.engine.sequence import Job, Sequence
from flywheel.engine.weights import WeightUpdater

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
"""Seconds a /health probe generation may take (SGLANG_HEALTH_CHECK_TIMEOUT)."""


class EngineNotReady(PlatformError, RuntimeError):
    http_status = 503
    error_type = "service_unavailable"


class EngineWorker:
    """Model owner and batch scheduler. Thread-safe public methods; one worker thread."""

    def __init__(
        self,
        settings: EngineSettings,
        model_path: Path,
        metrics: EngineMetrics | None = None,
    ):
        self.settings = settings
        self.model_path = Path(model_path)
        self.metrics = metrics or EngineMetrics()
        self.status = "loading"
        """loading | ready | failed | stopped."""
        self.error: str | None = None
        self.weight_version = settings.weight_version
        self.runner: ModelRunner | None = None
        self._work = WorkQueue()
        self._queued = 0
        """Rows submitted and not yet admitted or aborted (`max_queued_requests`)."""
        self._inflight: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.weights = WeightUpdater(self)
        """Disk and distributed weight updates, weight reads."""
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._rng = random.Random(settings.seed)
        self.last_progress = 0.0
        """time.monotonic() of the last decode step or finished batch (health checks)."""
        self._batch: RunningBatch | None = None
        self._grammars: GrammarCompiler | None = None
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.metrics.set_weight_version(self.weight_version)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.status == "ready"

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.abort("", abort_all=True)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.status = "stopped"
        with self._lock:
            left, self._inflight = list(self._inflight.values()), {}
        for job in left:  # queued rows that never ran: fail them rather than hang their callers
            if not job.future.done():
                job.future.set_exception(EngineNotReady("the engine stopped"))

    def _run(self) -> None:
        try:
            if self.settings.threads:
                torch.set_num_threads(self.settings.threads)
            t0 = time.perf_counter()
            self.runner = ModelRunner(self.model_path, self.settings.dtype, self.settings.device)
            check_context_length(self.settings, self.runner.config)
            self._grammars = GrammarCompiler(
                self.runner.tokenizer, self.runner.vocab_size, self.runner.eos_ids
            )
            self._batch = RunningBatch(self.runner)
            self._warm_up()
            log.info("model %s loaded in %.1f s", self.model_path, time.perf_counter() - t0)
            self.status = "ready"
        except Exception as e:  # reported by /health (503) and the log; the process stays up
            log.exception("loading %s failed", self.model_path)
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            self._ready.set()
        try:
            while self.status == "ready" and not self._stop.is_set():
                try:
                    self._loop_once()
                except Exception:  # keep serving; the failed batch's rows were already failed
                    log.exception("engine loop iteration failed")
        finally:
            if not self._stop.is_set() and self.status == "ready":  # /healthz turns 503
                self.status, self.error = "failed", "the engine worker loop exited"

    def _warm_up(self) -> None:
        job = Job(_probe_spec(), probe=True)
        self._admit([job])
        while self._batch is not None and len(self._batch):
            self._step()
        job.future.result(timeout=0)

    # -- public API (any thread) ------------------------------------------------------------------

    def submit(
        self,
        specs: list[RowSpec],
        *,
        probe: bool = False,
        listeners: list[Callable[[dict[str, Any]], None]] | None = None,
    ) -> list[Job]:
        """Queue rows for generation; each Job's future resolves to its response object.

        `listeners` (one per row) receive the cumulative response after every sampled token
        (streaming); they run on the worker thread and must not block.

        Raises:
            EngineNotReady: the model is still loading or failed to load.
            InvalidRequestError: a rid is already in flight; a grammar param (json_schema,
                regex, ebnf, structural_tag) does not compile.
        """
        if self.status != "ready":
            raise EngineNotReady(
                f"the engine is {self.status}" + (f": {self.error}" if self.error else "")
            )
        jobs = [Job(spec, probe=probe) for spec in specs]
        if any(spec.params.constrained for spec in specs):
            assert self._grammars is not None  # built before the engine turns ready
            renormalized = self.settings.grammar_logprobs == "renormalized"
            for job in jobs:  # xgrammar caches by text: rows of one request compile once
                job.grammar = self._grammars.compile(job.spec.params)
                job.renormalized_logprobs = renormalized and job.grammar is not None
        unheard: list[Callable[[dict[str, Any]], None] | None] = [None] * len(jobs)
        for job, listener in zip(jobs, listeners or unheard, strict=True):
            job.listener = listener
        with self._lock:
            rids = [j.spec.rid for j in jobs]
            if len(set(rids)) != len(rids) or any(r in self._inflight for r in rids):
                raise InvalidRequestError("Duplicate request ID detected")
            limit = self.settings.max_queued_requests
            if limit and not probe and self._queued + len(jobs) > limit:
                self.metrics.queue_rejected.inc(len(jobs))
                log.warning("request queue full (%d rows waiting): %d refused", limit, len(jobs))
                raise OverloadedError(
                    f"The request queue is full ({limit} rows wait for the running batch, "
                    "engine.max_queued_requests); retry later"
                )
            self._queued += len(jobs)
            for job in jobs:
                self._inflight[job.spec.rid] = job
        for job in jobs:
            self._work.put(job)
        self.metrics.queue_depth.inc(len(jobs))
        return jobs

    def abort(self, rid: str, abort_all: bool = False) -> int:
        """Abort every in-flight row whose rid starts with `rid` (all with abort_all)."""
        if not rid and not abort_all:
            return 0
        with self._lock:
            hit = [j for r, j in self._inflight.items() if abort_all or r.startswith(rid)]
            for job in hit:
                job.aborted = True
        return len(hit)

    def probe(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        """SGLang's /health check: queue a 1-token greedy generation and wait until it, or any
        other decode step, completes (a busy engine is healthy while it makes progress)."""
        if self.status != "ready":
            return False
        started = time.monotonic()
        (job,) = self.submit([_probe_spec()], probe=True)
        while time.monotonic() - started < timeout:
            if job.future.done():
                return job.future.exception() is None
            if self.last_progress > started:
                return True
            time.sleep(0.05)
        log.warning("health probe got no output within %.0f s", timeout)
        return False

    def set_weight_version(self, version: str) -> None:
        """Relabel the served weights (SGLang /update_weight_version) at the next step boundary."""
        self.control(lambda: self.relabel(version))

    def relabel(self, version: str) -> None:
        """Worker thread: new rows, and running rows from their next token, carry `version`."""
        self.weight_version = version
        self.metrics.set_weight_version(version)
        for seq in self._batch.seqs if self._batch is not None else []:
            seq.set_weight_version(version)

    def after_swap(self, version: str | None) -> None:
        """Worker thread, right after new weights were applied: recompute the running rows'
        next-token logits under them (so the next sampled token is the new weights'), then
        relabel to `version` when one is given."""
        if self._batch is not None and len(self._batch):
            self._batch.refresh_logits()
        if version is not None:
            self.relabel(version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """A parameter as float32 nested lists (see `WeightUpdater.get_by_name`).

        Raises:
            KeyError: no parameter has that name.
        """
        if self.runner is None:
            raise EngineNotReady("the engine is loading")
        return self.weights.get_by_name(name, truncate_size)

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer (None while loading); encode/decode are thread-safe."""
        return self.runner.tokenizer if self.runner is not None else None

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from generation_config.json (used by /v1/chat/completions only)."""
        return self.runner.generation_defaults if self.runner is not None else {}

    def model_info(self) -> dict[str, Any]:
        """model_type and architectures of the loaded model (None while loading)."""
        runner = self.runner
        return {
            "model_type": runner.model_type if runner else None,
            "architectures": runner.architectures if runner else None,
        }

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """Load a safetensors checkpoint into the live model (see `WeightUpdater.from_disk`)."""
        return self.weights.from_disk(
            model_path,
            weight_version,
            abort_all_requests=abort_all_requests,
            load_format=load_format,
        )

    def pause(self, mode: str = "abort") -> None:
        """SGLang /pause_generation: no decode step and no new row until `resume()`.

        mode "abort" aborts every in-flight row (their callers get partial output with
        finish_reason abort) and returns once they are drained; "in_place" freezes running rows
        with their KV cache and returns after the current step; "retract" behaves as in_place
        here (SGLang would recompute the retracted rows' KV after continue). New requests are
        accepted and wait.
        """
        if mode == "abort":
            self.abort("", abort_all=True)
        self._work.paused.set()
        self.control(lambda: None)

    def resume(self) -> None:
        self._work.paused.clear()

    @property
    def paused(self) -> bool:
        return self._work.paused.is_set()

    def control(self, fn: Callable[[], Any], *, drain: bool = False) -> Any:
        """Run `fn` on the worker thread between decode steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        item = Control(fn, drain=drain)
        self._work.put(item)
        return item.future.result()

    # -- worker thread ----------------------------------------------------------------------------

    def _loop_once(self) -> None:
        batch = self._batch
        assert batch is not None
        work = self._work
        idle = not len(batch) or work.paused.is_set()
        work.pull(POLL_S if idle else 0.0, self.settings.batch_wait_ms / 1000.0 if idle else 0.0)
        for job in work.take_aborted():  # aborted while queued (or held by a pause)
            self._finish_unstarted(job)
        for seq in batch.finish_aborted():
            self._finish(seq.job, result=seq.result(self._tokenizer()))
        while work.urgent:
            work.urgent.popleft().run()
        controls, jobs = work.admit(self.settings.max_batch_size - len(batch), len(batch))
        for item in controls:
            item.run()
        if jobs:
            self._unqueued(len(jobs))
            self._admit(jobs)
        if len(batch) and not work.paused.is_set():
            self._step()

    def _tokenizer(self) -> Any:
        assert self.runner is not None
        return self.runner.tokenizer

    def _admit(self, jobs: list[Job]) -> None:
        """Prepare rows, prefill them and merge them into the running batch."""
        runner, batch = self.runner, self._batch
        assert runner is not None and batch is not None
        seqs: list[Sequence] = []
        for job in jobs:
            try:
                seqs.append(self._sequence(runner, job))
            except InvalidRequestError as e:
                self._finish(job, error=e)
            except Exception as e:  # a bad row must never take the worker thread down
                log.exception("row %s could not be prepared", job.spec.rid)
                self._finish(job, error=InvalidRequestError(f"{type(e).__name__}: {e}"))
        for seq in seqs:
            seq.set_weight_version(self.weight_version)
        # aborted while queued, or prefill-only without input logprobs: nothing to compute
        for seq in [s for s in seqs if s.finished and not s.wants_input_logprobs]:
            seqs.remove(seq)
            self._finish(seq.job, result=seq.result(runner.tokenizer))
        if not seqs:
            return
        try:
            done = batch.add(seqs)
        except Exception as e:  # a bug or OOM in the prefill: fail these rows, keep serving
            log.exception("prefill of %d rows failed", len(seqs))
            for seq in seqs:
                self._finish(seq.job, error=e)
            return
        self.last_progress = time.monotonic()
        for seq in done:
            self._finish(seq.job, result=seq.result(runner.tokenizer))

    def _step(self) -> None:
        """One decode step of the running batch; finished rows resolve at once."""
        batch = self._batch
        assert batch is not None and self.runner is not None
        rows = len(batch)
        t0 = time.perf_counter()
        try:
            finished = batch.step()
        except Exception as e:  # a bug or OOM: fail the running rows, keep serving
            log.exception("decode step over %d rows failed", rows)
            for seq in batch.seqs:
                self._finish(seq.job, error=e)
            self._batch = RunningBatch(self.runner)
            return
        self.metrics.batch_size.observe(rows)
        self.metrics.batch_seconds.observe(time.perf_counter() - t0)
        self._on_step(rows)
        for seq in finished:
            self._finish(seq.job, result=seq.result(self.runner.tokenizer))

    def _finish_unstarted(self, job: Job) -> None:
        """Answer a row that was aborted before it was prefilled (SGLang: no prompt_tokens)."""
        self._unqueued(1)
        meta = {
            "id": job.spec.rid,
            "finish_reason": {"type": "abort", "message": job.abort_message},
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        self._finish(job, result={"text": "", "output_ids": [], "meta_info": meta})

    def _unqueued(self, rows: int) -> None:
        """`rows` left the queue (admitted, or aborted before they ran)."""
        with self._lock:
            self._queued -= rows
        self.metrics.queue_depth.dec(rows)

    def _on_step(self, tokens: int) -> None:
        self.last_progress = time.monotonic()
        self.metrics.generated_tokens.inc(tokens)

    def _sequence(self, runner: ModelRunner, job: Job) -> Sequence:
        spec = job.spec
        ids = (
            spec.input_ids
            if spec.input_ids is not None
            else runner.tokenizer.encode(spec.text or "")
        )
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < runner.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (size {runner.vocab_size})"
            )
        bad = [i for i in spec.token_ids_logprob or () if not 0 <= i < runner.vocab_size]
        if bad:
            raise InvalidRequestError(f"token_ids_logprob id {bad[0]} is outside the vocabulary")
        limit = self.settings.context_length - 1
        if len(ids) > limit:
            raise InvalidRequestError(
                f"Input length ({len(ids)} tokens) exceeds the maximum allowed length ({limit} "
                "tokens). Use a shorter input or raise engine.context_length."
            )
        if spec.return_logprob and spec.logprob_start_len > len(ids):
            raise InvalidRequestError(
                f"logprob_start_len ({spec.logprob_start_len}) is larger than the input "
                f"length ({len(ids)})"
            )
        cap = limit - len(ids)
        wanted = spec.params.max_new_tokens
        seed = spec.params.sampling_seed
        seq = Sequence(
            job,
            list(ids),
            max_new_tokens=cap if wanted is None else min(wanted, cap),
            eos_ids=runner.eos_ids,
            generator=torch.Generator().manual_seed(
                seed if seed is not None else self._rng.getrandbits(63)
            ),
        )
        seq.start()
        if not job.probe:
            self.metrics.prompt_tokens.inc(len(ids))
        return seq

    def _finish(
        self, job: Job, *, result: dict[str, Any] | None = None, error: Exception | None = None
    ) -> None:
        with self._lock:
            self._inflight.pop(job.spec.rid, None)
        if error is not None:
            job.future.set_exception(error)
            return
        assert result is not None
        if not job.probe:
            self.metrics.requests.labels(result["meta_info"]["finish_reason"]["type"]).inc()
        job.future.set_result(result)


def _probe_spec() -> RowSpec:
    return RowSpec(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        text=None,
        input_ids=[0],
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
    )
