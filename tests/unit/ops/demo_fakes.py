"""`flywheel demo` run through the CLI with a fake stack and a fake run: what the CLI built."""

from __future__ import annotations

import flywheel.ops.stack as stack_module
from flywheel.ops import cli
from flywheel.ops.demo import runner as runner_module

SUMMARY = {"first5": 0.2, "last5": 0.8, "eval_before": 0.5, "eval_after": 0.9, "steps": 2}


class FakeService:
    def __init__(self, name: str):
        self.name, self.url = name, f"http://{name}.invalid"


def run_demo_cli(monkeypatch, tmp_path, *flags: str):  # noqa: ANN201
    """Run `flywheel demo --new-stack --steps 2 <flags>`; returns (settings, runner, out dir).

    The stack's start/stop and the runner's run are fakes that only record what they were given.
    """
    seen = {}

    class FakeStack:
        def __init__(self, settings, config_file=None):  # noqa: ANN001
            seen["settings"] = settings
            self.services = [FakeService("gateway"), FakeService("engine")]
            self.redis, self.moved = None, {}  # every configured port was free

        def start(self) -> None: ...

        def stop(self) -> None: ...

    def fake_run(self, started_at=None):  # noqa: ANN001, ANN202
        seen["runner"] = self
        return SUMMARY

    monkeypatch.setattr(stack_module, "Stack", FakeStack)
    monkeypatch.setattr(runner_module.DemoRunner, "run", fake_run)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--new-stack", "--out", str(out), "--steps", "2", *flags]) == 0
    return seen["settings"], seen["runner"], out
