"""`flywheel down` with no stack running: its line points at a demo's own stack
(`FLYWHEEL_STATE_DIR=<out>/stack`) only when the state dir in use is not already one."""

from __future__ import annotations

from flywheel.ops import cli

HINT = "FLYWHEEL_STATE_DIR=runs/demo/stack flywheel down"


def test_down_from_a_demo_stack_folder_does_not_suggest_the_command_just_run(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", "runs/demo/stack")
    assert cli.main(["down"]) == 1
    err = capsys.readouterr().err
    assert "no stack runs from state dir runs/demo/stack" in err
    assert HINT not in err and "<out>/stack" not in err


def test_down_from_another_state_dir_points_at_a_demo_stack(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(tmp_path / ".flywheel"))
    assert cli.main(["down"]) == 1
    err = capsys.readouterr().err
    assert "no stack runs from state dir" in err and HINT in err
