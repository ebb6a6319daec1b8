"""Which demo `flywheel demo --task` runs: its runner class and its config with the task's
defaults for the settings the command line leaves unset (None)."""

from __future__ import annotations

from typing import Any

from flywheel.ops.demo.runner import DemoConfig, DemoRunner

DEFAULTS: dict[str, dict[str, int]] = {
    "addition": {"problems_per_step": 4, "group_size": 8},
    "agent": {"problems_per_step": 4, "group_size": 6},
}
"""Per task: the problems per step and rollouts per problem when not given."""


def demo_runner(task: str, **settings: Any) -> tuple[type[DemoRunner], DemoConfig]:
    """(runner class, config) for `task` ("addition" | "agent"); settings given as None take
    the task's default (`DEFAULTS`); `eval_seed` and `eval_size` apply to the agent task only.

    Raises:
        ValueError: an unknown task, or `eval_seed` / `eval_size` given for the addition task
            (it evaluates its fixed 30 held-out problems: the setting would not take effect).
    """
    if task not in DEFAULTS:
        raise ValueError(f"unknown demo task {task!r}; known: {sorted(DEFAULTS)}")
    given = {k: v for k, v in settings.items() if v is not None}
    merged = DEFAULTS[task] | given
    if task == "addition":
        if agent_only := [k for k in ("eval_seed", "eval_size") if k in given]:
            flags = " and ".join("--" + k.replace("_", "-") for k in agent_only)
            verb, them = ("apply", "them") if len(agent_only) > 1 else ("applies", "it")
            raise ValueError(
                f"{flags} {verb} to --task agent only; the addition task always evaluates its "
                f"30 held-out problems: leave {them} out, or add --task agent"
            )
        return DemoRunner, DemoConfig(**merged)
    from flywheel.ops.demo.agent_runner import AgentDemoConfig, AgentDemoRunner  # noqa: PLC0415

    return AgentDemoRunner, AgentDemoConfig(**merged)
