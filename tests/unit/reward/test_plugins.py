"""A user-defined reward inside the Scorer: its declared inputs come from the Sample, its value
becomes the "verifier" component, and a failure (exception, non-number, NaN, out of range)
leaves the Sample unscored with the reason, never 0."""

from __future__ import annotations

import asyncio
import json

import pytest

from flywheel.core.codec import new_sample
from flywheel.core.rewards import RewardRegistry, reward
from flywheel.reward import metrics
from flywheel.reward.plugins import check_value
from flywheel.reward.scoring import Scorer

REGISTRY = RewardRegistry()


@reward(
    "count_messages", inputs=("messages", "task", "next_state"), range=(0, 10), registry=REGISTRY
)
def count_messages(messages, task, next_state):
    # two messages + task bonus 1 + next state 0.5: 2 + 1 + 0.5 = 3.5
    return len(messages) + task.get("bonus", 0) + (0.5 if next_state == "ok" else 0)


@reward("text", inputs=("turn",), registry=REGISTRY)
def text(turn):
    return "1"


@reward("bounded", inputs=("task",), range=(0, 1), registry=REGISTRY)
def bounded(task):
    return task["value"]


def _sample(task, next_state=None):
    s = new_sample(task_json=json.dumps(task), sample_id="s")
    s.messages.add(role="user", content_json=json.dumps("q"))
    s.messages.add(role="assistant", content_json=json.dumps("a"))
    if next_state is not None:
        s.next_state.role = "user"
        s.next_state.content_json = json.dumps(next_state)
    return s


def _score(sample, default="count_messages"):
    return asyncio.run(Scorer(default, plugins=REGISTRY).score(sample))


def test_inputs_come_from_the_sample_and_the_value_is_the_verifier_component():
    s = _score(_sample({"bonus": 1}, "ok"))
    assert s.has_reward and dict(s.rewards) == {"verifier": 3.5} and s.reward == 3.5
    s = _score(_sample({}))  # no next state: None, no bonus: 2 + 0 + 0
    assert s.has_reward and s.reward == 2.0


def test_range_ends_are_included():
    assert check_value(REGISTRY.get("bounded"), 1).value == 1.0
    assert check_value(REGISTRY.get("bounded"), 0.0).value == 0.0


@pytest.mark.parametrize(
    ("task", "reason"),
    [
        ({"verifier": "text"}, "not_a_number"),
        ({"verifier": "bounded", "value": float("nan")}, "not_finite"),
        ({"verifier": "bounded", "value": 1.0000001}, "out_of_range"),
        ({"verifier": "bounded", "value": True}, "not_a_number"),
        ({"verifier": "bounded"}, "exception"),  # KeyError: 'value'
    ],
)
def test_failures_leave_the_sample_unscored_and_counted(task, reason):
    name = task["verifier"]
    counter = metrics.PLUGIN_UNSCORED.labels(name, reason)
    before = counter._value.get()
    sample = _sample(task)
    sample.rewards["outcome"] = 0.5
    s = _score(sample)
    assert not s.has_reward and "verifier" not in s.rewards
    assert s.error.startswith(f"reward {name} {reason}: ")
    assert counter._value.get() == before + 1


def test_an_unknown_verifier_lists_plugin_names():
    s = _score(_sample({"verifier": "nope", "answer": 1}))
    assert not s.has_reward and "'bounded', 'code_tests', 'count_messages'" in s.error


def test_components_run_on_every_sample_under_their_own_name_and_weight():
    scorer = Scorer("bounded", {"count_messages": 0.5}, plugins=REGISTRY)
    scorer.components = ("count_messages",)
    s = asyncio.run(scorer.score(_sample({"value": 0.25, "bonus": 1}, "ok")))
    # verifier "bounded" 0.25 (weight 1) + 0.5 * count_messages 3.5 = 0.25 + 1.75 = 2.0
    assert s.has_reward and dict(s.rewards) == {"verifier": 0.25, "count_messages": 3.5}
    assert s.reward == 2.0
    s = asyncio.run(scorer.score(_sample({"value": 0.25, "bonus": 20})))  # 2 + 20 > 10
    assert not s.has_reward and s.error.startswith("reward count_messages out_of_range: ")
    assert dict(s.rewards) == {"verifier": 0.25}


def test_the_factory_refuses_components_no_plugin_registers():
    from flywheel.core.errors import ConfigurationError  # noqa: PLC0415
    from flywheel.core.settings import load_settings  # noqa: PLC0415
    from flywheel.reward.factory import load_reward_plugins  # noqa: PLC0415

    rs = load_settings(reward={"plugins": ["json"], "components": ["missing_one"]}).reward
    with pytest.raises(ConfigurationError, match=r"reward.components \['missing_one'\]"):
        load_reward_plugins(rs)
    with pytest.raises(Exception, match="reward.plugins names no module"):
        load_settings(reward={"components": ["x"]})


def test_the_recipe_selects_its_example_reward(monkeypatch):
    from pathlib import Path  # noqa: PLC0415

    from flywheel.core.settings import load_settings  # noqa: PLC0415
    from flywheel.reward.factory import build_scorer, load_reward_plugins  # noqa: PLC0415

    recipes = Path(__file__).parents[3] / "recipes"
    monkeypatch.syspath_prepend(str(recipes / "plugins"))
    rs = load_settings(recipes / "plugin_reward.toml").reward
    assert "length_exact" in load_reward_plugins(rs)
    scorer = build_scorer(rs)
    sample = _sample({"answer": 8, "max_chars": 10})
    sample.messages[-1].content_json = json.dumps("So 7+1 is\n8")
    # 11 characters, budget 10: 1 - 1/10 = 0.9
    s = asyncio.run(scorer.score(sample))
    assert s.has_reward and dict(s.rewards) == {"verifier": pytest.approx(0.9)}
    sample.messages[-1].content_json = json.dumps("So 7+1 is\n9")  # wrong answer: 0.0, scored
    s = asyncio.run(scorer.score(sample))
    assert s.has_reward and dict(s.rewards) == {"verifier": 0.0}
