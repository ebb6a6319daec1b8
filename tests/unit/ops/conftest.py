"""Every ops test leaves the process's signal handling as it found it: commands run in-process
(`cli.main`, `run_demo`) install handlers for SIGINT and SIGTERM (`up.stop_on_signals`) and
remember that they are stopping, which a later test's Ctrl-C would otherwise meet."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from flywheel.ops import up


@pytest.fixture(autouse=True)
def restore_signal_handling() -> Iterator[None]:
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    # a test starts from Python's own handling, whatever earlier tests (in any folder) left
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    up._stopping = False
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
        up._stopping = False
