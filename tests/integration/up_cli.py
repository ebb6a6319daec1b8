"""`flywheel up` as a user runs it: `python -m flywheel.ops.cli up --config FILE` in a clean
environment (no FLYWHEEL_* variables of the test run leak in)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def up_command(config: Path) -> list[str]:
    """The command line of `flywheel up --config <config>`."""
    return [sys.executable, "-m", "flywheel.ops.cli", "up", "--config", str(config)]


def clean_env() -> dict[str, str]:
    """This process's environment without FLYWHEEL_* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}


def run_up(config: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `flywheel up` to its exit (for start-ups that fail); output captured as text.

    Raises:
        subprocess.TimeoutExpired: it ran past `timeout` seconds.
    """
    return subprocess.run(
        up_command(config), capture_output=True, text=True, env=clean_env(), timeout=timeout
    )
