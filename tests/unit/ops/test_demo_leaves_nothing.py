"""`flywheel demo` refused before it starts (a bad setting, a refusal of the running stack)
leaves nothing behind: neither its --out folder nor `demo.lock` in it. A demo that ran deletes
its `demo.lock` at the end, lists summary.json among the files it wrote and ends with the size
of its stack folder and the command that deletes it."""

from __future__ import annotations

import json
import os

import pytest

from flywheel.ops import cli
from flywheel.ops.stack import STATE_FILE
from tests.unit.core.http_stub import healthy_gateway

from .demo_fakes import run_demo_cli


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)


def test_a_demo_refused_for_a_bad_setting_creates_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_GATEWAY__PORT", "-1")
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--steps", "1", "--out", str(tmp_path / "x" / "d1")])
    assert "gateway.port in FLYWHEEL_GATEWAY__PORT" in str(exited.value.code)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def mismatched_running_stack(tmp_path, monkeypatch):
    """A running stack whose trainer trains steps the demo's defaults do not fill."""
    with healthy_gateway() as url:
        state = tmp_path / "state"
        state.mkdir()
        (state / STATE_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway": url}))
        trainer = {"batch": {"groups_per_step": 3, "group_size": 7}}
        (state / "settings.json").write_text(json.dumps({"trainer": trainer}))
        monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(state))
        yield


def test_a_demo_the_running_stack_refuses_leaves_no_folder_and_no_lock(
    mismatched_running_stack, tmp_path, capsys
):
    out = tmp_path / "x" / "d1"
    assert cli.main(["demo", "--steps", "1", "--out", str(out)]) == 2
    assert "trainer.batch.groups_per_step" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    assert cli.main(["demo", "--steps", "1", "--out", str(kept)]) == 2
    assert kept.is_dir() and os.listdir(kept) == []


def test_a_demo_that_ran_deletes_its_lock_and_says_what_its_stack_left(
    monkeypatch, tmp_path, capsys
):
    _, _, out = run_demo_cli(monkeypatch, tmp_path)
    printed = capsys.readouterr().out
    assert not (out / "demo.lock").exists()
    assert f"and {out / 'summary.json'}" in printed, printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"flywheel: the demo's stack folder {out / 'stack'} holds "), last
    assert last.endswith(f"delete it with: rm -rf {out / 'stack'}"), last
