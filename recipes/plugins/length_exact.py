"""A user-defined reward to copy: exact match on the reply's last line, penalised by length.

Selected by `recipes/plugin_reward.toml` (`reward.plugins = ["length_exact"]`,
`reward.default_verifier = "length_exact"`); run with this directory on the import path:
`PYTHONPATH=recipes/plugins flywheel up --config recipes/plugin_reward.toml`.
"""

from __future__ import annotations

from typing import Any

from flywheel.core.rewards import reward


@reward("length_exact", inputs=("turn", "task"), range=(0.0, 1.0))
def length_exact(turn: str, task: dict[str, Any]) -> float:
    """1.0 when the reply's last non-empty line equals `task["answer"]` and the reply fits in
    `task["max_chars"]` characters (default 200); past that, falling linearly to 0 at twice the
    budget; 0.0 for a wrong answer.

    Example: answer "8", max_chars 10, reply "So 7+1 is\\n8" (11 chars): 1 over the budget,
    1 - 1/10 = 0.9. A task without "answer" raises KeyError: the Sample is left unscored.
    """
    budget = int(task.get("max_chars", 200))
    lines = [line.strip() for line in turn.strip().splitlines() if line.strip()]
    if not lines or lines[-1] != str(task["answer"]).strip():
        return 0.0
    over = max(0, len(turn.strip()) - budget)
    return max(0.0, 1.0 - over / budget)
