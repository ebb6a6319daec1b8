"""`flywheel demo`'s command line: its options (`add_demo_arguments`) and the API key its
requests carry (`--api-key`, env FLYWHEEL_API_KEY), checked against the gateway before the
first step (`access_refusal`)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

API_KEY_ENV = "FLYWHEEL_API_KEY"
"""Environment variable holding the demo's API key when `--api-key` is not given."""


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an integer >= `low`."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {number}")
        return number

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    """The options of `flywheel demo`."""
    demo.add_argument("--steps", type=positive_int, default=30, help="trainer steps (default 30)")
    demo.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    demo.add_argument(
        "--task",
        choices=["addition", "agent"],
        default="addition",
        help="addition (default): single-digit sums, one reply; agent: an openai-agents "
        "program adds 6-digit numbers with a calculator tool over several turns",
    )
    demo.add_argument(
        "--problems-per-step",
        type=positive_int,
        default=None,
        help="problems (groups) per trainer step, at least 1 (default 4)",
    )
    demo.add_argument(
        "--group-size",
        type=positive_int,
        default=None,
        help="rollouts per problem (default 8 for addition, 6 for agent); the trainer's "
        "group-relative advantage needs 2 or more",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the training problems' draw and order (default 0)",
    )
    demo.add_argument(
        "--eval-seed",
        type=int,
        default=None,
        help="agent task: the held-out draw evaluated (default 0); the untrained model is also "
        "evaluated on draw eval-seed + 1 to show the evaluation's noise",
    )
    demo.add_argument(
        "--eval-size",
        type=positive_int,
        default=None,
        help="agent task: held-out problems per evaluation (default 30)",
    )
    demo.add_argument(
        "--mode",
        choices=["async", "sync"],
        default="async",
        help="async (default): rollouts run up to --max-staleness steps ahead of the served "
        "weights; sync: each step waits for the previous step's weights",
    )
    demo.add_argument(
        "--max-staleness",
        type=non_negative_int,
        default=1,
        help="steps the rollouts may run ahead of the served weights in async mode, and the "
        "trainer's max_staleness on a stack the demo starts (default 1; 0 = sync)",
    )
    demo.add_argument(
        "--new-stack", action="store_true", help="start a fresh stack even if one is running"
    )
    demo.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help="API key sent by every agent and by the demo's own session requests, for a "
        "gateway that requires keys (create one with `flywheel keys create --role agent`); "
        f"default: env {API_KEY_ENV}, else none (a local gateway with no keys serves "
        "clients without one)",
    )


def demo_options(
    args: argparse.Namespace, trainer_timeline: Path, state_dir: str | Path
) -> dict[str, Any]:
    """The `DemoRunner` keywords the command line gives: the trainer's timeline file, the API
    key (`--api-key`, env FLYWHEEL_API_KEY), the stack's log folder (`<state_dir>/logs`) and
    the `--config` file (repeated in the commands its hints print)."""
    return {
        "trainer_timeline": trainer_timeline,
        "api_key": args.api_key,
        "logs": Path(state_dir) / "logs",
        "config_file": args.config,
    }


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (links not followed; 0 when it is not there)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def size_text(size: int) -> str:
    """`size` bytes in decimal units: 1_100_000_000 -> "1.1 GB", 3_000_000 -> "3.0 MB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def stack_folder_note(stack_dir: Path) -> str:
    """The interrupted demo's line on the folder its own stack ran from: where, its size, and
    the command that deletes it (the next demo with the same --out replaces it too)."""
    return (
        f"flywheel: the demo's stack folder {stack_dir} holds {size_text(folder_bytes(stack_dir))} "
        "(Redis data, checkpoints, logs); delete it with: "
        f"rm -rf {shlex.quote(str(stack_dir))}"
    )


def replace_stack_folder(stack_dir: Path, echo: Callable[[str], None] = print) -> None:
    """Delete the stack folder an earlier demo with the same `--out` left (its Redis data,
    checkpoints and logs), first saying so in one line with its size; nothing when there is
    none. The caller holds the folder (`demo_folder`): no stack runs from it."""
    if not stack_dir.exists():
        return
    echo(
        f"flywheel demo: deleting the previous run's stack folder {stack_dir} "
        f"({size_text(folder_bytes(stack_dir))}: Redis data, checkpoints, logs)"
    )
    shutil.rmtree(stack_dir, ignore_errors=True)


def out_problem(out: Path) -> str | None:
    """What is wrong with `--out` as the demo's folder, creating it (and its parents) when it
    is missing; None when the demo can write its files there.

    Examples: an existing file -> "exists and is not a folder"; "/proc/nope" -> "cannot be
    created (No such file or directory)".
    """
    if out.exists() and not out.is_dir():
        return "exists and is not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file (or a link to one) somewhere on its path
        return "cannot be created (a file is in its path)"
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    if not os.access(out, os.W_OK | os.X_OK):
        return "is a folder the demo cannot write to"
    return None


DEMO_LOCK = "demo.lock"
"""File in `--out` that a running demo holds an exclusive lock on (its process id inside)."""


def missing_folders(out: Path) -> list[Path]:
    """`out` and those of its parents that do not exist yet, deepest first: what `out_problem`
    creates, and `demo_folder` removes again when the demo leaves nothing in them."""
    missing = []
    for folder in (out, *out.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing


@contextlib.contextmanager
def demo_folder(out: Path, created: list[Path] | tuple[()] = ()) -> Iterator[str | None]:
    """Hold `out`'s demo lock (`<out>/demo.lock`, released by the OS when the process dies)
    while the block runs, so a second demo with the same `--out` neither deletes this one's
    stack folder nor truncates its files. Yields None; or, holding nothing, the line refusing
    the demo when another demo holds the lock or a stack runs from `<out>/stack` (its
    `stack.lock` held, as `Stack` holds it from its start to its stop). Afterwards deletes the
    lock file while it is still this demo's, and the `created` folders (`missing_folders`)
    the demo left empty (refused before it started)."""
    try:
        with _held_lock(out) as refusal:
            yield refusal
    finally:
        for folder in created:
            with contextlib.suppress(OSError):  # not empty: the demo wrote its files there
                folder.rmdir()


@contextlib.contextmanager
def _held_lock(out: Path) -> Iterator[str | None]:
    """`demo_folder`'s lock: taken on the file `<out>/demo.lock` names (again when another
    demo deleted it meanwhile), deleted at the end while it is still the one held."""
    path = out / DEMO_LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            yield _busy_refusal(out, f"a demo (process {holder}) is running with --out {out}")
            return
        if _same_file(fd, path):
            break
        os.close(fd)  # the demo that held it deleted it on its way out: lock the new one
    try:
        if _stack_running(out / "stack"):
            yield _busy_refusal(out, f"a stack is running from {out / 'stack'}")
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield None
    finally:
        if _same_file(fd, path):
            path.unlink()
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the open file `fd`."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _stack_running(stack_dir: Path) -> bool:
    """Whether a process holds `<stack_dir>/stack.lock` (a stack runs or starts there)."""
    from flywheel.ops.stack import LOCK_FILE  # noqa: PLC0415  (not for demo/failures.py's import)

    try:
        fd = os.open(stack_dir / LOCK_FILE, os.O_RDWR)
    except OSError:  # no lock file: no stack ever started there
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock taken just now
    return False


def _busy_refusal(out: Path, what: str) -> str:
    """The line refusing a demo whose `--out` is in use by `what` (a running demo or stack):
    how to stop it (its stack with `flywheel down` when one runs from `<out>/stack`)."""
    from flywheel.ops.stack import down_command  # noqa: PLC0415

    stack = out / "stack"
    stop = "Ctrl-C where it runs"
    if _stack_running(stack):
        stop += f", or `{down_command(str(stack))}`"
    return (
        f"flywheel demo: {what}; this demo would delete its stack folder and overwrite its "
        f"files. Stop it first ({stop}), or pass another --out"
    )
