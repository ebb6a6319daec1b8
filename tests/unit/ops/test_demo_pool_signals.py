"""A Ctrl-C that the OS hands to one of the demo's episode threads (any thread of the process may
take a process-directed signal) still interrupts the main thread's wait for the episodes while
they run, not once the episode it waits for has ended (minutes for a generation), so the demo
still finds them in flight to cancel. The signal is sent to a worker thread itself
(`pthread_kill`): the handler, which Python runs in the main thread, lets the episodes end."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from flywheel.ops.demo.pool import EpisodePool


def _until_the_main_thread_waits() -> None:
    """Return once the main thread is blocked waiting for an episode's result (in `threading`'s
    `Condition.wait`, under `EpisodePool.map` and not under its `submit`, which waits for a
    new worker to start), where only a signal delivered to it, or the wait's end, wakes it."""
    main = threading.main_thread().ident
    deadline = time.monotonic() + 30  # bounded: a failure, not a hang
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if names[:1] == ["wait"] and "map" in names and "submit" not in names:
            return
        time.sleep(0.01)


def test_a_signal_a_worker_takes_interrupts_the_wait_while_the_episodes_run():
    handled = threading.Event()

    def on_sigint(_signum: int, _frame: object) -> None:
        handled.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)  # restored by conftest
    pool = EpisodePool(max_workers=2)
    both_running = threading.Barrier(2)
    workers: list[threading.Thread] = []
    ended_by_the_handler: list[bool] = []

    def episode(i: int) -> int:
        workers.append(threading.current_thread())
        both_running.wait(30)
        if i == 0:
            _until_the_main_thread_waits()
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # this worker takes it
        ended_by_the_handler.append(handled.wait(30))  # bounded: a failure, not a hang
        return i

    with pytest.raises(KeyboardInterrupt):
        list(pool.map(episode, [0, 1]))
    pool.shutdown()
    for thread in workers:
        thread.join(60)
    assert ended_by_the_handler == [True, True]
