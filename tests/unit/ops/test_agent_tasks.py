"""The tool demo's task generator and verifier (flywheel.ops.demo.agent_tasks) and its
evaluation aggregate, with worked examples, malformed tool calls and answers included."""

from __future__ import annotations

import itertools

import pytest

from flywheel.ops.demo.agent_runner import EpisodeResult, EvalStats
from flywheel.ops.demo.agent_tasks import (
    HIGH,
    LOW,
    PROMPTS,
    AdditionProblem,
    episode_reward,
    has_call_markup,
    held_out,
    is_held_out,
    parse_answer,
    training_batches,
)


def test_problem_question_answer_and_task():
    p = AdditionProblem(483920, 718263, phrasing=0)
    assert p.question == "What is 483920 + 718263?"
    assert p.answer == 1202183  # 483920 + 718263
    assert p.task == {"answer": 1202183, "verifier": "none", "question": p.question}
    word = AdditionProblem(100, 200, phrasing=4).question
    assert "100" in word and "200" in word and word == PROMPTS[4].format(a=100, b=200)


def test_held_out_rule_worked_examples():
    assert not is_held_out(100000, 100002)  # 100000 + 300006 = 400006 = 7*57143 + 5
    assert not is_held_out(100001, 100002)  # 400007 = 7*57143 + 6
    assert is_held_out(100002, 100002)  # 400008 = 7*57144


def test_held_out_draws_differ_by_seed_and_never_meet_training():
    first, second = held_out(0), held_out(1)
    assert len(first) == len(second) == 30
    assert first == held_out(0)  # a draw is repeatable
    assert {(p.a, p.b) for p in first}.isdisjoint({(p.a, p.b) for p in second})
    train = [p for batch in itertools.islice(training_batches(0, 8), 50) for p in batch]
    assert len(train) == 400
    assert not any(is_held_out(p.a, p.b) for p in train)
    assert all(is_held_out(p.a, p.b) for p in first + second)
    assert all(LOW <= x <= HIGH for p in train + first for x in (p.a, p.b))
    assert len({p.phrasing for p in train}) == len(PROMPTS)  # every phrasing is trained


def test_training_seed_never_replays_an_evaluation_draw():
    # Different rule sides already keep them apart; the streams also differ per seed.
    a = next(training_batches(0, 4))
    b = next(training_batches(1, 4))
    assert a != b and a == next(training_batches(0, 4))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1202183", 1202183),
        ("The sum is 1202183.", 1202183),
        ("1,202,183", 1202183),  # thousands separators
        ("483920 + 718263 = 1202183", 1202183),  # the last number is the answer
        ("-5", -5),
        ("", None),
        ("I cannot add these numbers.", None),
        # A call the gateway's parser could not read reaches the agent as text: malformed.
        ('<tool_call>\n{"name": "add", "arguments": {"a": 483920, "b": 7182', None),
        ('{"name": "add", "arguments": {"a": 1, "b": 2}} 3', None),
        ("tool_call add 1 2", None),
    ],
)
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


def test_call_markup():
    assert has_call_markup("<tool_call>{}")
    assert has_call_markup("</tool_call>")
    assert has_call_markup('{"name": "add"}')
    assert not has_call_markup("The answer is 12, named after nothing.")


@pytest.mark.parametrize(
    ("final", "malformed", "reward"),
    [
        ("1202183", 0, 1.0),
        ("The answer is 1,202,183", 0, 1.0),
        ("1202184", 0, 0.0),  # off by one
        ("120218", 0, 0.0),  # a digit dropped in copying
        ("", 0, 0.0),  # no answer (e.g. the turn budget ran out)
        ("1202183", 1, 0.0),  # right number after a malformed call
        ('<tool_call>{"name": "add", "arguments": {"a": 483920}}</tool_call> 1202183', 0, 0.0),
    ],
)
def test_episode_reward(final, malformed, reward):
    assert episode_reward(final, 1202183, malformed_calls=malformed) == reward


def test_eval_stats_worked_example():
    results = [EpisodeResult(1.0, 1, 0), EpisodeResult(0.0, 1, 1), EpisodeResult(0.0, 0, 0)]
    stats = EvalStats.of(results)
    assert stats.success == pytest.approx(1 / 3)  # one reward 1 of three
    assert stats.tool_use == pytest.approx(2 / 3)  # two episodes ran the tool
    assert stats.well_formed == pytest.approx(2 / 3)  # 2 ran of 2 + 1 attempts
    assert stats.episodes == 3
    none_tried = EvalStats.of([EpisodeResult(0.0, 0, 0)])
    assert none_tried.well_formed is None and none_tried.tool_use == 0.0
    all_bad = EvalStats.of([EpisodeResult(0.0, 0, 2)])
    assert all_bad.well_formed == 0.0  # 0 ran of 2 attempts


def test_training_seed_4_asks_what_is_first_in_the_first_two_steps():
    # tests/integration/test_demo_agent.py relies on it: phrasing 0 ("What is a + b?") in both.
    batches = list(itertools.islice(training_batches(4, 2), 2))
    assert [[p.phrasing for p in b] for b in batches] == [[0, 1], [0, 1]]
