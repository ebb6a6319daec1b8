"""`flywheel down`: stop the stack that runs from the state dir, from another shell.

The stack's state file (`<state_dir>/stack.json`) names the process that supervises it:
`flywheel up`, or `flywheel demo` on a stack of its own. That process gets SIGTERM, which stops
its services in reverse order as Ctrl-C does, and `down` waits for it to exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from flywheel.core.settings import load_settings_or_exit
from flywheel.ops.stack import STATE_FILE, process_alive, stack_state

WAIT_S = 180.0
"""Seconds `flywheel down` waits for the stack's process to exit (its services stop first)."""


def cmd_down(args: argparse.Namespace) -> int:
    """Run `flywheel down`: SIGTERM to the stack's process, then wait for it to exit.

    Returns 0 once it exited, 1 when no stack runs from the state dir or it did not exit within
    `WAIT_S` seconds (with a line on stderr saying what to do).
    """
    settings = load_settings_or_exit(args.config)
    state = stack_state(settings.state_dir)
    if state is None:
        print(nothing_runs(settings.state_dir), file=sys.stderr)
        return 1
    pid = int(state["pid"])
    print(f"stopping the stack of {settings.state_dir} (process {pid})...", flush=True)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if not process_alive(pid):
            print("stopped.")
            return 0
        time.sleep(0.5)
    print(
        f"flywheel: process {pid} did not exit within {WAIT_S:.0f} s; its services may still be "
        f"stopping. Check again, or `kill -9 {pid}` and then its services' processes.",
        file=sys.stderr,
    )
    return 1


DEMO_STACK_HINT = (
    " A demo's own stack runs from <out>/stack: FLYWHEEL_STATE_DIR=runs/demo/stack flywheel down"
)


def nothing_runs(state_dir: str) -> str:
    """`flywheel down`'s line when no stack runs from `state_dir`. It points at a demo's own
    stack (`<out>/stack`) unless `state_dir` already is one (a folder named `stack`): the hint
    would repeat the command just run.

    Example: ".flywheel" -> "... no stack runs from state dir .flywheel (...). A demo's own
    stack runs from <out>/stack: ..."; "runs/demo/stack" -> the same without the hint.
    """
    line = (
        f"flywheel: no stack runs from state dir {state_dir} (no live "
        f"{Path(state_dir) / STATE_FILE})."
    )
    return line if Path(state_dir).resolve().name == "stack" else line + DEMO_STACK_HINT
