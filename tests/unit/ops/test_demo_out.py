"""`flywheel demo --out DIR` that cannot be the demo's folder (an existing file, a path that
cannot be created) is refused at once with one line naming what is wrong (exit 2), on a running
stack as on a stack of the demo's own, never a traceback. The running stack is a stub gateway
over real HTTP named by the state dir's state file."""

from __future__ import annotations

import json
import os

import pytest

from flywheel.ops import cli
from flywheel.ops.stack import STATE_FILE
from tests.unit.core.http_stub import healthy_gateway


@pytest.fixture
def running_stack(tmp_path, monkeypatch):
    with healthy_gateway() as url:
        state = tmp_path / "state"
        state.mkdir()
        stack = {"pid": os.getpid(), "gateway": url, "engine": url}
        (state / STATE_FILE).write_text(json.dumps(stack))
        monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(state))
        yield state


@pytest.mark.parametrize("new_stack", [False, True], ids=["running-stack", "new-stack"])
def test_an_existing_file_as_out_is_refused_in_one_line(running_stack, tmp_path, capsys, new_stack):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    flags = ["--new-stack"] if new_stack else []
    code = cli.main(["demo", "--out", str(taken), "--api-key", "K", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().count("\n") == 0, err
    assert f"--out {taken}" in err and "not a folder" in err, err
    assert taken.read_text() == "mine"


def test_an_out_that_cannot_be_created_is_refused_in_one_line(running_stack, capsys):
    code = cli.main(["demo", "--out", "/proc/nope", "--api-key", "K"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().count("\n") == 0, err
    assert "--out /proc/nope" in err and "cannot be created" in err, err
