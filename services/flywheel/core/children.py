"""How the local stack starts its long-running children (Redis and every service).

Each child runs in a session of its own (`start_new_session`), so a terminal's Ctrl-C, which
goes to the whole foreground process group, reaches only the command that started them: it
then stops them in its order (services in reverse start order, Redis last). On Linux a child
also gets SIGTERM when that command dies (`PR_SET_PDEATHSIG`), so a command killed outright
(SIGKILL) leaves no child running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a process gets when its parent (the thread that forked it) dies."""


def own_session() -> dict[str, Any]:
    """`subprocess.Popen` keywords for a child of the local stack: a session of its own, and on
    Linux SIGTERM when this process dies. The parent-death signal is set only when called from
    the main thread: the kernel sends it when the forking thread ends, not the process."""
    kwargs: dict[str, Any] = {"start_new_session": True}
    on_death = _term_on_parent_death()
    if on_death is not None and threading.current_thread() is threading.main_thread():
        kwargs["preexec_fn"] = on_death
    return kwargs


def _term_on_parent_death() -> Callable[[], None] | None:
    """The function run in the forked child before it executes its program (None off Linux):
    it asks for SIGTERM on the parent's death, and exits at once if the parent already died."""
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl
    parent = os.getpid()

    def set_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl: nobody would stop this child
            os._exit(1)

    return set_signal
