"""`flywheel demo --mode/--max-staleness`: the runner's config and the trainer settings of the
stack the demo starts (the stack and the run are fakes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import flywheel.ops.stack as stack_module
from flywheel.ops import cli
from flywheel.ops.demo import runner as runner_module

from .demo_fakes import SUMMARY, run_demo_cli

_demo = run_demo_cli


def test_demo_defaults_to_async_with_max_staleness_one(monkeypatch, tmp_path):
    settings, runner, out = _demo(monkeypatch, tmp_path)
    assert runner.cfg.mode == "async" and runner.cfg.max_staleness == 1
    assert runner.staleness == 1
    assert settings.trainer.staleness.max_staleness == 1
    assert (
        runner.trainer_timeline
        == Path(settings.trainer.logging.metrics_path).parent / "timeline.jsonl"
    )
    assert runner.trainer_timeline == out / "timeline.jsonl"


def test_demo_mode_and_max_staleness_flags(monkeypatch, tmp_path):
    settings, runner, _ = _demo(monkeypatch, tmp_path, "--mode", "sync", "--max-staleness", "3")
    assert runner.cfg.mode == "sync" and runner.staleness == 0  # sync paces as staleness 0
    assert settings.trainer.staleness.max_staleness == 3
    settings, runner, _ = _demo(monkeypatch, tmp_path, "--max-staleness", "0")
    assert runner.cfg.mode == "async" and runner.staleness == 0
    assert settings.trainer.staleness.max_staleness == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-staleness", "-1"], "argument --max-staleness: must be at least 0, got -1"),
        (["--max-staleness", "x"], "argument --max-staleness: 'x' is not an integer"),
        (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    ],
)
def test_demo_rejects_bad_pacing_flags_before_anything_starts(tmp_path, capsys, flags, message):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--new-stack", "--out", str(out), *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_on_a_running_stack_the_resolved_trainer_settings_name_the_timeline(
    monkeypatch, tmp_path, capsys
):
    state = tmp_path / "state"
    state.mkdir()
    metrics = tmp_path / "elsewhere" / "trainer_metrics.jsonl"
    (state / "settings.json").write_text(
        json.dumps(
            {
                "trainer": {
                    "logging": {"metrics_path": str(metrics)},
                    "staleness": {"max_staleness": 0},
                }
            }
        )
    )
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(state))
    monkeypatch.setattr(
        stack_module,
        "running_stack",
        lambda _: {"gateway": "http://gateway.invalid", "engine": "http://engine.invalid"},
    )
    seen = {}

    def fake_run(self, started_at=None):  # noqa: ANN001, ANN202
        seen["runner"] = self
        return SUMMARY

    monkeypatch.setattr(runner_module.DemoRunner, "run", fake_run)
    assert cli.main(["demo", "--out", str(tmp_path / "demo"), "--steps", "2"]) == 0
    assert seen["runner"].trainer_timeline == metrics.parent / "timeline.jsonl"
    err = capsys.readouterr().err
    assert "may lag 1 weight versions" in err and "max_staleness is 0" in err


@pytest.mark.parametrize(
    ("flags", "asks"),
    [
        (["--group-size", "1"], "--problems-per-step 4 --group-size 8"),
        (["--problems-per-step", "2"], "--problems-per-step 4 --group-size 8"),
        (["--task", "agent"], "flywheel demo --task agent --problems-per-step 4 --group-size 8"),
    ],
)
def test_on_a_running_stack_groups_that_do_not_fill_its_trainer_steps_are_refused_at_start(
    monkeypatch, tmp_path, capsys, flags, asks
):
    state = tmp_path / "state"
    state.mkdir()
    batch = {"group_size": 8, "groups_per_step": 4}  # the agent task's default group is 6
    (state / "settings.json").write_text(json.dumps({"trainer": {"batch": batch}}))
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(state))
    monkeypatch.setattr(
        stack_module,
        "running_stack",
        lambda _: {"gateway": "http://gateway.invalid", "engine": "http://engine.invalid"},
    )
    ran = []
    monkeypatch.setattr(runner_module.DemoRunner, "run", lambda *a, **k: ran.append(a))
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--steps", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flywheel: the running trainer trains steps of ")
    assert "trainer.batch.groups_per_step = 4" in err and "trainer.batch.group_size = 8" in err
    assert asks in err and "--new-stack" in err
    assert ran == [] and not (out / "metrics.jsonl").exists()


def test_async_demo_splits_a_shared_cpu_and_pauses_engines_in_place(monkeypatch):
    from flywheel.core.settings import load_settings
    from flywheel.ops import cli as cli_module

    monkeypatch.setattr(cli_module.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(cli_module, "_cuda_available", lambda: False)
    settings = load_settings()
    cli_module._share_the_machine(settings)
    assert (settings.engine.threads, settings.trainer.threads) == (2, 2)  # 4 cores, half each
    assert settings.trainer.push.pause == "in_place"
    # what the user set stays as set
    chosen = load_settings(engine={"threads": 3}, trainer={"push": {"pause": "none"}})
    cli_module._share_the_machine(chosen)
    assert (chosen.engine.threads, chosen.trainer.threads) == (3, 0)
    assert chosen.trainer.push.pause == "none"


def test_the_demo_process_asks_for_cuda_without_importing_torch():
    # a fresh interpreter runs the demo's settings step: torch answers in a child process, so
    # the demo's own process (alive for the whole run) never holds torch's ~220 MiB; this
    # machine has no GPU, so the child's answer splits the cores as on a CPU
    code = (
        "import sys; from flywheel.core.settings import load_settings; "
        "from flywheel.ops import cli; s = load_settings(); cli._share_the_machine(s); "
        "print('torch' in sys.modules, s.engine.threads > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--eval-size", "7"], "--eval-size applies to --task agent only"),
        (["--eval-seed", "3", "--eval-size", "7"], "--eval-seed and --eval-size apply to"),
    ],
)
def test_agent_only_eval_flags_are_refused_for_the_addition_task(tmp_path, capsys, flags, named):
    """The addition task evaluates its fixed held-out set: an --eval-* flag would not take
    effect, so it is refused before anything starts (exit 2), not silently ignored."""
    out = tmp_path / "demo"
    code = cli.main(["demo", "--new-stack", "--out", str(out), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert f"flywheel demo: {named}" in err and "--task agent" in err
    assert ("leave them out" if len(flags) > 2 else "leave it out") in err, err
    assert not out.exists()
