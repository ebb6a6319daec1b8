"""The demo's episode pool: worker threads the interpreter does not wait for at exit.

`concurrent.futures.ThreadPoolExecutor` joins its workers when the interpreter exits, even after
`shutdown(wait=False)`: a demo stopped by Ctrl-C or SIGTERM, its summary written, would still
wait for every episode blocked in a request to the gateway (a generation, up to the client's
600 s timeout). These workers are daemon threads: once the demo's main thread is done, the
process exits, and the episodes' connections close with it.

The main thread waits for an episode in slices of `SIGNAL_CHECK_S`: the OS may hand a Ctrl-C or
SIGTERM to any thread of the process, and when a worker takes it, Python only runs the handler
once the main thread executes Python code again; an unbounded wait would hold the interrupt
until that episode ended (minutes for a generation), and its in-flight episodes would no longer
be in flight to cancel."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait
from typing import Any, TypeVar

P = TypeVar("P")
R = TypeVar("R")

_Job = tuple[Future[Any], Callable[[Any], Any], Any]

SIGNAL_CHECK_S = 0.2
"""The longest the main thread waits for an episode without running Python code, so a signal
another thread took is handled within it."""


class EpisodePool:
    """Up to `max_workers` daemon threads running `map`'s calls; `shutdown` cancels the calls
    not yet begun."""

    def __init__(self, max_workers: int, name: str = "demo-episode"):
        self.max_workers = max_workers
        self.name = name
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.idle = threading.Semaphore(0)
        """Released by a worker each time it ends a call: a submit takes an idle worker before
        it starts a new one."""
        self.closed = False
        self.lock = threading.Lock()
        weakref.finalize(self, self.jobs.put, None)  # unused and collected: its workers end

    def submit(self, fn: Callable[[P], R], item: P) -> Future[R]:
        """`fn(item)` in a worker; its future."""
        future: Future[R] = Future()
        with self.lock:
            if self.closed:
                raise RuntimeError("the episode pool is shut down")
            self.jobs.put((future, fn, item))
            if not self.idle.acquire(blocking=False) and len(self.threads) < self.max_workers:
                worker = threading.Thread(
                    target=_work,
                    args=(self.jobs, self.idle),
                    name=f"{self.name}-{len(self.threads)}",
                    daemon=True,
                )
                worker.start()
                self.threads.append(worker)
        return future

    def map(self, fn: Callable[[P], R], items: Iterable[P]) -> Iterator[R]:
        """`fn` of each item, run in the workers; yields the results in order (a call's
        exception is raised when its result is reached). The calls not yet begun are cancelled
        when the caller stops early (an exception, a KeyboardInterrupt)."""
        futures = [self.submit(fn, item) for item in items]
        try:
            for future in futures:
                while not future.done():  # wakes to run the handler of a signal (module doc)
                    wait([future], timeout=SIGNAL_CHECK_S)
                yield future.result()
        finally:
            for future in futures:
                future.cancel()

    def shutdown(self) -> None:
        """Cancel the calls not yet begun and let each worker end after its current call,
        without waiting for them."""
        with self.lock:
            self.closed = True
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            self.jobs.put(None)  # each worker hands it on to the next


def _work(jobs: queue.SimpleQueue[_Job | None], idle: threading.Semaphore) -> None:
    """A worker: runs the jobs until it gets None, which it puts back for the others. It holds
    no reference to its pool, so a pool nobody uses any more is collected and its workers end."""
    while (job := jobs.get()) is not None:
        future, fn, item = job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(item))
            except BaseException as exc:  # noqa: BLE001 (the caller gets it from the future)
                future.set_exception(exc)
        del future, fn, item, job  # nothing of the last call held while idle
        idle.release()
    jobs.put(None)
