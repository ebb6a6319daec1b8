"""running_stack: a state file left by a dead `flywheel up`, or one that cannot be read (with
a warning naming it), is not a running stack; the state file is written atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.core.settings import load_settings
from flywheel.ops.stack import STATE_FILE, Stack, running_stack

from .http_stub import healthy_gateway


def test_state_of_a_dead_up_is_ignored_even_when_its_gateway_port_answers(tmp_path):
    # Another stack now answers on the recorded gateway port: only the pid tells them apart.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with healthy_gateway() as gateway:
        (tmp_path / STATE_FILE).write_text(json.dumps({"pid": dead.pid, "gateway": gateway}))
        assert running_stack(str(tmp_path)) is None
        (tmp_path / STATE_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway": gateway}))
        assert running_stack(str(tmp_path)) == {"pid": os.getpid(), "gateway": gateway}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"pid": 1, "gate', "Unterminated string"),  # cut off mid-write
        ("[]", "a JSON list, not an object"),
        (b"\xff\xfe", "codec can't decode"),
    ],
)
def test_an_unreadable_state_file_is_no_running_stack_with_a_warning(tmp_path, content, reason):
    path = tmp_path / STATE_FILE
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    warnings = []
    assert running_stack(str(tmp_path), warn=warnings.append) is None
    assert len(warnings) == 1
    assert f"unreadable stack state file {path}" in warnings[0] and reason in warnings[0]


def _cli(tmp_path, *argv):
    config = tmp_path / "flywheel.toml"
    config.write_text(
        f'state_dir = "{tmp_path}"\n[redis]\nurl = "redis://127.0.0.1:1/0"\n'
        "[gateway]\nport = 1\n[engine]\nport = 1\n[trainer]\nport = 1\n"
        "[reward]\nport = 1\nmetrics_port = 1\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    return subprocess.run(
        [sys.executable, "-m", "flywheel.ops.cli", *argv, "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "argv", [["status"], ["keys", "list"], ["check-fidelity", "--session", "s1"]]
)
def test_commands_survive_a_corrupt_state_file(tmp_path, argv):
    (tmp_path / STATE_FILE).write_text('{"pid": 1, "gate')
    run = _cli(tmp_path, *argv)
    assert "Traceback" not in run.stderr, run.stderr
    assert (
        f"flywheel: ignoring the unreadable stack state file {tmp_path / STATE_FILE}" in run.stderr
    )
    assert run.returncode != 0  # nothing answers at the configured addresses


def test_the_state_file_is_replaced_atomically(tmp_path, monkeypatch):
    stack = Stack(load_settings(state_dir=str(tmp_path)), echo=lambda _: None)
    path = tmp_path / STATE_FILE
    path.write_text(json.dumps({"pid": 1, "gateway": "http://127.0.0.1:1"}))
    real_write = Path.write_text

    def crash_mid_write(self, data, *args, **kwargs):  # e.g. the disk fills up
        real_write(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", crash_mid_write)
    with pytest.raises(OSError, match="No space"):
        stack._write_state()
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"pid": 1, "gateway": "http://127.0.0.1:1"}
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temp file left behind
    stack._write_state()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]
