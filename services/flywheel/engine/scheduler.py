"""The worker's inbox: generation jobs and control items in arrival order, with pausing.

Items arrive on a thread-safe inbox and are moved, in order, into `waiting` by the worker
thread (`pull`). Between decode steps the worker asks `admit()` for the jobs that may join the
running batch (up to the free room) and the controls that may run now:

* an urgent control (`drain=False`: pause barriers, weight reads, relabels, weight swaps with
  `engine.weight_swap = "step"`) runs at the next step boundary, whatever is running;
* a draining control (`drain=True`: weight swaps with `engine.weight_swap = "drain"`) keeps
  its place in line: jobs that arrived before it are admitted first, jobs after it wait, and
  it runs once no row is running, so an update never mixes weights inside a request (SGLang's
  writer lock). While paused it runs at once (SGLang: an update on a paused engine proceeds
  immediately).

While paused (SGLang /pause_generation) no job is admitted; queued jobs that get aborted are
released at once (as abort results).
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
    """A function the worker runs between decode steps; its result resolves `future`."""

    fn: Callable[[], Any]
    drain: bool = False
    """Run only when no row is running (or at once while paused)."""
    future: Future[Any] = field(default_factory=Future)

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as e:  # surfaced to the caller waiting on the future
            self.future.set_exception(e)


class WorkQueue:
    def __init__(self) -> None:
        self._inbox: queue.Queue[Job | Control] = queue.Queue()
        self.waiting: deque[Job | Control] = deque()
        self.urgent: deque[Control] = deque()
        self.paused = threading.Event()

    def put(self, item: Job | Control) -> None:
        self._inbox.put(item)

    def pull(self, block_s: float = 0.0, linger_s: float = 0.0) -> None:
        """Move everything in the inbox into `waiting` / `urgent`.

        Args:
            block_s: seconds to wait for a first item when the inbox is empty.
            linger_s: after a first item arrived, seconds to keep collecting (so requests sent
                together are prefilled together).
        """
        timeout = block_s
        deadline: float | None = None
        while True:
            try:
                item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Control) and not item.drain:
                self.urgent.append(item)
            else:
                self.waiting.append(item)
            if deadline is None:
                deadline = time.monotonic() + linger_s
            timeout = max(0.0, deadline - time.monotonic())

    def take_aborted(self) -> list[Job]:
        """Remove and return queued jobs whose abort flag is set."""
        aborted = [j for j in self.waiting if isinstance(j, Job) and j.aborted]
        if aborted:
            self.waiting = deque(j for j in self.waiting if not (isinstance(j, Job) and j.aborted))
        return aborted

    def admit(self, room: int, running: int) -> tuple[list[Control], list[Job]]:
        """Controls to run now (before the jobs), then up to `room` jobs to prefill."""
        controls: list[Control] = []
        if self.paused.is_set():
            controls = [c for c in self.waiting if isinstance(c, Control)]
            self.waiting = deque(j for j in self.waiting if isinstance(j, Job))
            return controls, []
        jobs: list[Job] = []
        while self.waiting:
            item = self.waiting[0]
            if isinstance(item, Control):
                if running or jobs:
                    break  # wait until the rows that arrived before it are done
                controls.append(item)
                self.waiting.popleft()
                continue
            if len(jobs) >= room:
                break
            jobs.append(item)
            self.waiting.popleft()
        return controls, jobs

    def __len__(self) -> int:
        return sum(isinstance(j, Job) for j in self.waiting) + self._inbox.qsize()
