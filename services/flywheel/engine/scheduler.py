"""The worker's inbox: generation jobs and control items in arrival order, with pausing.

`next_batch()` takes the first waiting job, then waits up to `batch_wait_s` for more, up to
`max_batch_size`. A control item (weight swap, pause barrier) ends the collection: the jobs
collected before it run first, then the control, so a control never interrupts a batch and
never overtakes jobs that arrived before it.

While paused (SGLang /pause_generation), controls still run but new jobs are held until
`/continue_generation`; held jobs that get aborted are released at once (as abort results).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flywheel.engine.sequence import Job

POLL_S = 0.2
"""Seconds an idle worker blocks on the inbox before re-checking stop and pause flags."""


@dataclass
class Control:
    """A function the worker runs between batches; its result resolves `future`."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as e:  # surfaced to the caller waiting on the future
            self.future.set_exception(e)


class WorkQueue:
    def __init__(self) -> None:
        self._inbox: queue.Queue[Job | Control] = queue.Queue()
        self._held: deque[Job] = deque()
        self.paused = threading.Event()

    def put(self, item: Job | Control) -> None:
        self._inbox.put(item)

    def _get(self, timeout: float) -> Job | Control | None:
        try:
            return self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def next_batch(self, max_size: int, wait_s: float) -> tuple[list[Job], list[Control]]:
        """Jobs to decode together and the controls to run after them (both may be empty)."""
        if self.paused.is_set():
            return self._while_paused()
        if self._held:
            first: Job | Control | None = self._held.popleft()
        else:
            first = self._get(POLL_S)
        if first is None:
            return [], []
        if isinstance(first, Control):
            return [], [first]
        jobs: list[Job] = [first]
        deadline = time.monotonic() + wait_s
        while len(jobs) < max_size:
            if self._held:
                jobs.append(self._held.popleft())
                continue
            item = self._get(deadline - time.monotonic())
            if item is None:
                break
            if isinstance(item, Control):
                return jobs, [item]
            jobs.append(item)
        return jobs, []

    def _while_paused(self) -> tuple[list[Job], list[Control]]:
        aborted = [j for j in self._held if j.aborted]
        if aborted:
            self._held = deque(j for j in self._held if not j.aborted)
            return aborted, []
        item = self._get(POLL_S)
        if isinstance(item, Control):
            return [], [item]
        if item is not None:
            if item.aborted:
                return [item], []
            self._held.append(item)
        return [], []
