"""The agent demo's evaluations: a held-out draw whose every episode failed measured nothing, so
its success, tool_use and well_formed are None (null in summary.json, n/a in the summary line),
never 0.0, and its line says how many episodes failed. Real HTTP: a stub gateway that refuses
every session (503)."""

from __future__ import annotations

import json

from flywheel.ops.demo.agent_runner import AgentDemoConfig, AgentDemoRunner
from flywheel.ops.demo.runner import summary_line

from ..core.http_stub import JsonHandler, serving


class _Refusing(JsonHandler):
    """A gateway that cannot open a session."""

    def do_POST(self) -> None:  # noqa: N802
        self._json(503, {"error": {"message": "no engine is ready", "code": None}})


def test_an_agent_evaluation_whose_every_episode_failed_is_null_and_counted(tmp_path):
    lines: list[str] = []
    with serving(_Refusing) as gateway:
        cfg = AgentDemoConfig(eval_size=3, problems_per_step=1, group_size=2)
        runner = AgentDemoRunner(gateway, gateway, cfg, tmp_path, lines.append)
        assert runner._timed_evaluate(0) is None
        runner.evaluate_draw(7)  # stands for the evaluation after training
    assert [seed for seed, _ in runner.evals] == [0, 1, 7]
    for _, stats in runner.evals:
        assert (stats.success, stats.tool_use, stats.well_formed) == (None, None, None)
        assert (stats.episodes, stats.failed) == (3, 3)
    for seed in (0, 1, 7):
        assert f"  not measured: all 3 episodes of draw {seed} failed" in lines, lines
    assert "evaluation not measured: all 6 held-out episodes failed" in lines, lines
    assert not any(line.startswith("  success") for line in lines), lines
    assert sum("episode" in line and "503" in line for line in lines) == 9, lines

    extra = runner.summary_extra()
    assert extra == {
        "eval_before_seed2": None,
        "tool_use_before": None,
        "tool_use_after": None,
        "well_formed_before": None,
        "well_formed_after": None,
    }
    assert json.loads(json.dumps(extra))["eval_before_seed2"] is None
    line = summary_line({"eval_before": None, "eval_after": None, **extra})
    assert "eval_before_seed2=n/a" in line and "tool_use_before=n/a" in line, line
