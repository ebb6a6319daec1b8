"""`flywheel up`: start the local stack, then supervise it until Ctrl-C.

Every `CHECK_S` seconds the watch loop starts the stack's own Redis again if it died (with its
AOF data) and restarts any service whose process exited (engine, teacher engine, gateway,
reward, teacher, trainer) with the same command, settings and log, printing one line on stderr
per restart and one more when it is healthy again. A service restarted more than
`supervise.max_restarts` times within `supervise.window_s` seconds stops the stack, with its
exit code and the end of its log. A restarted engine comes back on its initial weights: the
gateways hold it as pending (routed no request) until it serves the fleet's weight version,
which the trainer's fleet watcher pushes to it (docs/fleet.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flywheel.core.settings import load_settings_or_exit

if TYPE_CHECKING:
    from flywheel.ops.stack import Stack

START_FAILURES = (RuntimeError, OSError, ValueError, subprocess.CalledProcessError)
"""What `Stack.start` raises when the stack cannot start (busy state dir, a service that exits or
never gets healthy, an unreachable Redis, a bad setting, a failed model conversion)."""
CHECK_S = 2.0
"""Seconds between `flywheel up`'s checks that every service (and its Redis) still runs."""
AFTER_RESTART = {
    "trainer": "it resumes from its newest checkpoint and commit log",
    "engine": "it is routed no request until the trainer pushed it the fleet's weights",
    "teacher-engine": "it serves the same frozen teacher weights",
    "gateway": "sessions and recorded Samples are in Redis; clients retry",
    "reward": "it scores the Samples left unacknowledged in the stream",
    "teacher": "it takes the Samples left unacknowledged in the stream",
}


def _err(message: str) -> None:
    print(f"flywheel: {message}", file=sys.stderr, flush=True)


def start_failed(stack: Any, exc: BaseException) -> None:
    """Stop what `stack.start` left running and say why it failed, in place of a traceback."""
    stack.stop()
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, subprocess.CalledProcessError):
        message = f"{exc}; see the output above"
    print(f"flywheel: {message}", file=sys.stderr)


@dataclass
class Supervisor:
    """Restarts the exited services of a started `Stack`, at most `max_restarts` times each
    within `window_s` seconds.

    Args:
        stack: a started `flywheel.ops.stack.Stack`.
        max_restarts: restarts of one service allowed within `window_s` (>= 0).
        window_s: seconds over which restarts are counted.
        say: called with one message per event (stderr in `flywheel up`).
        clock: monotonic seconds (a stand-in in unit tests).
    """

    stack: Any
    max_restarts: int
    window_s: float
    say: Callable[[str], None] = _err
    clock: Callable[[], float] = time.monotonic
    restarts: dict[str, deque[float]] = field(default_factory=dict)
    recovering: dict[str, float] = field(default_factory=dict)
    """Services restarted and not yet healthy -> when they were restarted."""

    def check(self) -> str:
        """One pass: restart every exited service within its allowance; report the ones that
        became healthy again. Returns "" while the stack runs, else the message to stop it with
        (the exit report of the service past its allowance)."""
        now = self.clock()
        for service in self.stack.exited():
            times = self.restarts.setdefault(service.name, deque())
            while times and now - times[0] > self.window_s:
                times.popleft()
            if len(times) >= self.max_restarts:
                return (
                    f"{service.exit_report()}\nflywheel: {service.name} exited "
                    f"{len(times) + 1} times within {self.window_s:g} s "
                    f"(supervise.max_restarts = {self.max_restarts}); stopping the stack."
                )
            code = self.stack.revive(service.name)
            if code is None:
                continue
            times.append(now)
            self.recovering[service.name] = now
            self.say(
                f"{service.name} exited with {code}; started it again ({len(times)} of "
                f"{self.max_restarts} within {self.window_s:g} s): "
                f"{AFTER_RESTART.get(service.name, 'same settings')}. "
                f"Log: {self.stack.state_dir}/logs/{service.name}.log"
            )
        for service in list(self.stack.services):
            since = self.recovering.get(service.name)
            if since is not None and service.health():
                del self.recovering[service.name]
                self.say(f"{service.name} is healthy again ({now - since:.0f} s after restart)")
        return ""


class Interrupted(KeyboardInterrupt):
    """The KeyboardInterrupt `stop_on_signals` raises; `signum`: the signal that stopped the
    command (SIGINT or SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_stopping = False
"""True once `_interrupt` raised: the command is stopping (writing its summary, stopping its
stack)."""
ALREADY_STOPPING = b"flywheel: already stopping; the files and the stack's stop are on their way\n"


def _interrupt(signum: int, _frame: object) -> None:
    """Raise `Interrupted` for the first signal only. A later one (a second Ctrl-C while the
    demo writes its summary and plots, or while the stack stops) must not cut that short: it
    gets one line on stderr, written with `os.write` (a signal handler that `print`s into a
    stream the main thread is writing raises a reentrant-call error)."""
    global _stopping
    if not _stopping:
        _stopping = True
        raise Interrupted(signum)
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), ALREADY_STOPPING)


def interrupted_exit(exc: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by `exc`: 128 + its signal's number, as a shell
    reports a process the signal ended (130 for Ctrl-C, 143 for SIGTERM); 130 for a plain
    KeyboardInterrupt."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


def stop_on_signals() -> None:
    """Ctrl-C (even when started from a script with SIGINT ignored) and SIGTERM raise
    KeyboardInterrupt (`Interrupted`, naming the signal) in the main thread, so a command's
    `finally` stops the stack it started, also while the services are still starting. Only the
    first signal interrupts; later ones print one line (`_interrupt`)."""
    global _stopping
    _stopping = False
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def moved_port_warnings(stack: Stack) -> list[str]:
    """One console line per service of `stack` that did not get its configured port
    (`Stack.moved`), naming the port it got and the address clients must use."""
    urls = {svc.name: svc.url for svc in stack.services}
    if stack.redis is not None:
        urls["redis"] = stack.redis.url
    return [
        f"WARNING: {name} is on port {port}, not its configured port {configured} (that one "
        f"is taken). Clients must use {urls.get(name, f'port {port}')} as printed; a client "
        "config that keeps this port may reach another deployment once a later `flywheel up` "
        f"gets {configured} again. `flywheel status` shows the addresses in use."
        for name, (configured, port) in stack.moved.items()
    ]


def cmd_up(args: argparse.Namespace) -> int:
    """Run `flywheel up`: start the stack, supervise it, stop it on Ctrl-C or SIGTERM (exit 0),
    or when it cannot start or a service keeps exiting (exit 1, the reason on stderr)."""
    from flywheel.ops.stack import (  # noqa: PLC0415
        Stack,
        StackBusyError,
        down_command,
        running_stack,
    )

    settings = load_settings_or_exit(args.config)
    if running_stack(settings.state_dir):
        print(
            f"flywheel: a stack is already running from {settings.state_dir}; stop it first "
            f"with `{down_command(settings.state_dir)}`, or use another state_dir.",
            file=sys.stderr,
        )
        return 1
    stack = Stack(settings, config_file=args.config, echo=lambda line: print(line, flush=True))
    stop_at_end = True
    """False once a failed start has stopped (or never started) the stack."""

    stop_on_signals()
    try:
        try:
            stack.start()
        except StackBusyError as exc:
            print(f"flywheel: {exc}.", file=sys.stderr)
            stop_at_end = False
            return 1
        except START_FAILURES as exc:
            start_failed(stack, exc)
            stop_at_end = False
            return 1
        gateway = next(s.url for s in stack.services if s.name == "gateway")
        print(
            f"flywheel is up. Point an OpenAI client at {gateway}/v1 (or a session's "
            "base_url). Ctrl-C stops everything.",
            flush=True,
        )
        for line in moved_port_warnings(stack):
            print(line, flush=True)
        sup = settings.supervise
        supervisor = Supervisor(stack, sup.max_restarts, sup.window_s)
        while True:
            time.sleep(CHECK_S)
            try:
                code = stack.revive_redis()
            except START_FAILURES as exc:
                _err(f"redis exited and did not start again ({exc}); stopping the stack.")
                return 1
            if code is not None:
                assert stack.redis is not None  # a code: the stack's own Redis, started again
                _err(
                    f"redis exited with {code}; started it again on {stack.redis.url} with its "
                    "data (AOF). The services wait out the gap."
                )
            stop = supervisor.check()
            if stop:
                _err(stop)
                return 1
    except KeyboardInterrupt:
        print("\nstopping...")
        return 0
    finally:
        if stop_at_end:
            stack.stop()
            print("stopped.", flush=True)
