"""`flywheel demo --task agent`: the runner and config it builds and the trainer settings of the
stack it starts (the stack and the run are fakes; the real run is
tests/integration/test_demo_agent.py)."""

from __future__ import annotations

import pytest

from flywheel.ops import cli
from flywheel.ops.demo.agent_runner import AgentDemoConfig, AgentDemoRunner
from flywheel.ops.demo.runner import DemoConfig, DemoRunner, summary_line
from flywheel.ops.demo.tasks_choice import demo_runner

from .demo_fakes import SUMMARY, run_demo_cli


def _demo(monkeypatch, tmp_path, *flags: str):  # noqa: ANN202
    settings, runner, _ = run_demo_cli(monkeypatch, tmp_path, *flags)
    return settings, runner


def test_task_agent_builds_the_agent_runner_with_its_defaults(monkeypatch, tmp_path):
    settings, runner = _demo(
        monkeypatch, tmp_path, "--task", "agent", "--eval-seed", "5", "--eval-size", "7"
    )
    assert isinstance(runner, AgentDemoRunner) and isinstance(runner.cfg, AgentDemoConfig)
    assert (runner.cfg.problems_per_step, runner.cfg.group_size) == (4, 6)
    assert runner.cfg.eval_seed == 5 and runner.cfg.eval_size == 7 and runner.cfg.max_tokens == 48
    assert runner.cfg.temperature == 0.7  # the addition demo samples at 1.0
    assert settings.trainer.batch.group_size == 6  # the trainer's groups match the demo's
    assert settings.trainer.batch.groups_per_step == 4
    # a group is trained only once complete: its episodes end minutes apart on a busy CPU
    assert settings.trainer.batch.group_wait_s == cli.AGENT_GROUP_WAIT_S == 3600.0


def test_default_task_is_the_addition_demo(monkeypatch, tmp_path):
    settings, runner = _demo(monkeypatch, tmp_path, "--group-size", "3")
    assert type(runner) is DemoRunner and type(runner.cfg) is DemoConfig
    assert (runner.cfg.problems_per_step, runner.cfg.group_size) == (4, 3)
    assert settings.trainer.batch.group_size == 3
    assert settings.trainer.batch.group_wait_s == 120.0  # the trainer's default, untouched


def test_task_agent_keeps_a_group_wait_the_user_set(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYWHEEL_TRAINER__BATCH__GROUP_WAIT_S", "30")
    settings, _ = _demo(monkeypatch, tmp_path, "--task", "agent")
    assert settings.trainer.batch.group_wait_s == 30.0


def test_demo_runner_choice():
    cls, cfg = demo_runner("agent", steps=3, group_size=None, eval_seed=2)
    assert cls is AgentDemoRunner and cfg.group_size == 6 and cfg.steps == 3
    cls, cfg = demo_runner("addition", steps=3, eval_seed=None, eval_size=None)
    assert cls is DemoRunner and cfg.group_size == 8
    with pytest.raises(ValueError, match="--eval-seed applies to --task agent only.*leave it out"):
        demo_runner("addition", steps=3, eval_seed=2, eval_size=None)  # agent only
    with pytest.raises(ValueError, match="unknown demo task 'chess'"):
        demo_runner("chess")


def test_unknown_task_is_refused_by_the_command_line(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--task", "chess"])
    assert "invalid choice: 'chess'" in capsys.readouterr().err


def test_summary_line_keeps_the_demo_format_and_adds_fields():
    line = summary_line(
        {**SUMMARY, "minutes": 12.345, "eval_before_seed2": 0.4, "well_formed_before": None}
    )
    assert line == (
        "reward first5=0.200 last5=0.800 eval_before=0.500 eval_after=0.900 steps=2 "
        "minutes=12.3 eval_before_seed2=0.400 well_formed_before=n/a"
    )
