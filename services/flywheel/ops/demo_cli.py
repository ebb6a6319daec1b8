"""`flywheel demo`'s command line: its options (`add_demo_arguments`) and the API key its
requests carry (`--api-key`, env FLYWHEEL_API_KEY), checked against the gateway before the
first step (`access_refusal`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
from collections.abc import Callable
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
    key (`--api-key`, env FLYWHEEL_API_KEY) and the stack's log folder (`<state_dir>/logs`)."""
    return {
        "trainer_timeline": trainer_timeline,
        "api_key": args.api_key,
        "logs": Path(state_dir) / "logs",
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
