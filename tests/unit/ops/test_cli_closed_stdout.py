"""`flywheel ... | head`: a reader that closes stdout early ends the command quietly (exit 141,
as a Unix tool killed by SIGPIPE), never a BrokenPipeError traceback; and the `make pi` that
tools/pi/package.json names exists and installs what the pi test fixture looks for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flywheel.ops.cli import CLOSED_STDOUT_EXIT, main

ROOT = Path(__file__).resolve().parents[3]


class _ClosedPipe:
    """A stdout whose reader went away: every write and flush raises BrokenPipeError."""

    def write(self, _: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_the_command_quietly(monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["config", "show"]) == CLOSED_STDOUT_EXIT


def test_a_closed_pipe_gives_no_traceback_in_a_real_process(tmp_path):
    """The reader's end is closed before the command writes: its print fails with EPIPE."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.ops.cli", "config", "show"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the interpreter has imported the CLI
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == CLOSED_STDOUT_EXIT, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_make_pi_installs_the_pinned_client_where_its_fixture_looks():
    described = json.loads((ROOT / "tools/pi/package.json").read_text())["description"]
    assert "make pi" in described
    plan = subprocess.run(
        ["make", "-n", "pi"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "cd tools/pi && npm ci" in plan  # from the lock file, as the fixture installs it
    assert "tools/pi/node_modules/.flywheel-lock-sha256" in plan  # the fixture's stamp
