"""The `@reward` decorator and its registry: good declarations register, bad ones are refused
at decoration (= at plugin import) with a message naming the problem; the plugin loader turns
import failures into ConfigurationError; settings refuse an unknown default verifier."""

from __future__ import annotations

import sys

import pytest

from flywheel.core.errors import ConfigurationError
from flywheel.core.rewards import BUILTIN_VERIFIERS, REGISTRY, RewardRegistry, load_plugins, reward
from flywheel.core.settings import load_settings


def test_a_declaration_registers_the_function_unchanged():
    registry = RewardRegistry()

    @reward("short", inputs=("turn", "next_state"), range=(-1, 1), registry=registry)
    def short(turn, next_state):
        return -1.0

    spec = registry.get("short")
    assert spec is not None and spec.fn is short and short("x", None) == -1.0
    assert (spec.inputs, spec.low, spec.high, spec.module) == (
        ("turn", "next_state"),
        -1.0,
        1.0,
        __name__,
    )
    assert registry.names() == ["short"] and "short" in registry


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": ("turn", "answer")}, "unknown: ['answer']"),
        ({"inputs": ()}, "at least one"),
        ({"inputs": ("turn", "turn")}, "distinct"),
        ({"range": (1, 0)}, "low < high"),
        ({"range": (0, 0)}, "low < high"),
        ({"range": (0, float("inf"))}, "finite"),
        ({"range": (0, "high")}, "two numbers"),
        ({"range": (0,)}, "two numbers"),
    ],
)
def test_bad_declarations_are_refused(kwargs, message):
    registry = RewardRegistry()
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[").replace("]", r"\]")):

        @reward("r", registry=registry, **kwargs)
        def r(turn, task=None, next_state=None):
            return 0.0

    assert registry.names() == []


@pytest.mark.parametrize("name", ["", "  ", "step/0", "exact", "none", 3])
def test_bad_or_reserved_names_are_refused(name):
    with pytest.raises(ConfigurationError, match="name"):
        reward(name, registry=RewardRegistry())(lambda turn, task: 0.0)


def test_a_function_that_cannot_take_its_inputs_is_refused():
    with pytest.raises(
        ConfigurationError, match=r"must accept the declared inputs \['turn', 'task'\]"
    ):

        @reward("r", registry=RewardRegistry())
        def r(response):
            return 0.0


def test_duplicate_name_is_refused_and_the_first_kept():
    registry = RewardRegistry()

    @reward("dup", registry=registry)
    def first(turn, task):
        return 1.0

    with pytest.raises(ConfigurationError, match="registered twice"):

        @reward("dup", registry=registry)
        def second(turn, task):
            return 0.0

    assert registry.get("dup").fn is first


def test_load_plugins_registers_and_refuses_bad_modules(tmp_path, monkeypatch):
    (tmp_path / "good_rewards.py").write_text(
        "from flywheel.core.rewards import reward\n"
        "@reward('unit_good_reward', inputs=('task',))\n"
        "def good(task):\n    return 0.5\n"
    )
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "bad_decl_rewards.py").write_text(
        "from flywheel.core.rewards import reward\n"
        "@reward('unit_bad', inputs=('transcript',))\n"
        "def bad(transcript):\n    return 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "unit_good_reward" in load_plugins(["good_rewards"])
        assert REGISTRY.get("unit_good_reward").fn(task={}) == 0.5
        load_plugins(["good_rewards"])  # importing again registers nothing twice
        with pytest.raises(ConfigurationError, match="'broken_rewards' failed on import: Runt"):
            load_plugins(["broken_rewards"])
        with pytest.raises(ConfigurationError, match="'bad_decl_rewards': reward 'unit_bad'"):
            load_plugins(["bad_decl_rewards"])
        with pytest.raises(ConfigurationError, match="'nope_rewards' cannot be imported"):
            load_plugins(["nope_rewards"])
    finally:
        REGISTRY._specs.pop("unit_good_reward", None)
        for m in ("good_rewards", "broken_rewards", "bad_decl_rewards"):
            sys.modules.pop(m, None)


def test_builtin_names_match_the_reward_service_verifiers():
    from flywheel.reward.verifiers import VERIFIERS  # noqa: PLC0415

    assert set(BUILTIN_VERIFIERS) == set(VERIFIERS)


def test_settings_refuse_an_unknown_default_verifier_without_plugins():
    with pytest.raises(Exception, match="'exactt' is not a verifier"):
        load_settings(reward={"default_verifier": "exactt"})
    assert load_settings(reward={"default_verifier": "mine", "plugins": ["m"]}).reward.plugins == [
        "m"
    ]


@pytest.mark.parametrize("name", ["verifier", "outcome", "judge", "step", "rubric"])
def test_component_names_are_reserved(name):
    with pytest.raises(ConfigurationError, match="built-in verifier or component"):
        reward(name, registry=RewardRegistry())(lambda turn, task: 0.0)


def test_a_component_name_is_not_a_default_verifier():
    with pytest.raises(Exception, match="'outcome' is not a verifier: use one of last_integer"):
        load_settings(reward={"default_verifier": "outcome"})
