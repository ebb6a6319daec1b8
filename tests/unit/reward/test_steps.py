"""Episode step scores (per-turn PRM with votes) and the weighted combination of every component
(verifier, environment outcome, step, rubric), each kept by name."""

import asyncio
import json

import httpx
import pytest

from flywheel.core.codec import new_sample
from flywheel.core.judge_client import AsyncJudgeClient, judge_metrics
from flywheel.reward.judge import NextStateJudge, RubricJudge
from flywheel.reward.scoring import Scorer, is_unjudged


def _by_turn(verdicts):
    """A judge that answers by which turn it sees: the response block holds 'turn <k>'."""
    seen = []

    def handler(request):
        prompt = json.loads(request.content)["messages"][0]["content"]
        response_block = prompt.split("The assistant's response")[1]
        turn = next(k for k in verdicts if f"turn {k}" in response_block.split("next state")[0])
        seen.append(turn)
        verdict = verdicts[turn]
        if isinstance(verdict, int) and verdict >= 400:
            return httpx.Response(verdict)
        return httpx.Response(
            200,
            json={"choices": [{"message": {"content": f"reasoning\nFinal verdict: {verdict}"}}]},
        )

    return handler, seen


def _client(handler, attempts=1):
    return AsyncJudgeClient(
        "http://judge/v1",
        "m",
        name="step",
        max_attempts=attempts,
        backoff_s=0.001,
        transport=httpx.MockTransport(handler),
        metrics=judge_metrics("reward"),
    )


def _episode(task=None):
    s = new_sample(task_json=json.dumps({"answer": 8} if task is None else task), mode="episode")
    for role, content in [
        ("user", "What is 7 + 1? Use the calculator."),
        ("assistant", "turn 0: calling the calculator"),
        ("tool", "8"),
        ("assistant", "turn 1: it says 8, let me double check"),
        ("user", "Just answer."),
        ("tool", "(user is waiting)"),
        ("assistant", "turn 2: 8"),
    ]:
        s.messages.add(role=role, content_json=json.dumps(content))
    return s


def test_each_followed_turn_gets_a_step_score_and_the_last_turn_none():
    handler, seen = _by_turn({0: "+1", 1: "-1", 2: "0"})
    scorer = Scorer("last_integer", step_judge=NextStateJudge(_client(handler), "prm_v2", votes=3))
    s = asyncio.run(scorer.score(_episode()))
    assert sorted(seen) == [0, 0, 0, 1, 1, 1]  # 3 votes per judged turn; turn 2 is
    assert s.rewards["step/0"] == 1.0  # final: no next state to judge
    assert s.rewards["step/1"] == -1.0
    assert "step/2" not in s.rewards
    # step = mean(+1, -1) = 0.0; reward = verifier 1.0 + step 0.0 (step/<k> are not summed)
    assert s.rewards["step"] == 0.0 and s.reward == 1.0 and s.has_reward
    assert [v.judge for v in s.votes] == ["step/0:prm@v2"] * 3 + ["step/1:prm@v2"] * 3


def test_next_state_of_a_step_is_every_message_until_the_next_assistant_turn():
    prompts = []

    def handler(request):
        prompts.append(json.loads(request.content)["messages"][0]["content"])
        return httpx.Response(200, json={"choices": [{"message": {"content": "Final verdict: 0"}}]})

    scorer = Scorer("none", step_judge=NextStateJudge(_client(handler), "prm_v2", votes=1))
    asyncio.run(scorer.score(_episode()))
    turn1 = next(
        p
        for p in prompts
        if "turn 1:" in p.split("The next state")[0].split("The assistant's response")[1]
    )
    next_state = turn1.split("The next state (role: user):")[1]
    assert "Just answer." in next_state and "(user is waiting)" in next_state


def test_an_unjudged_step_makes_the_episode_unjudged_and_keeps_the_judged_steps():
    handler, _ = _by_turn({0: "+1", 1: 503, 2: "0"})
    scorer = Scorer(
        "last_integer", step_judge=NextStateJudge(_client(handler, attempts=2), "prm_v2", votes=1)
    )
    s = asyncio.run(scorer.score(_episode()))
    assert is_unjudged(s) and not s.has_reward
    assert s.error.startswith("unjudged: step/1 infra/server_error")
    assert s.rewards["step/0"] == 1.0 and "step" not in s.rewards and "step/1" not in s.rewards
    assert s.reward == 1.0  # the verifier alone


def test_every_component_kept_by_name_and_combined_by_weight():
    step_handler, _ = _by_turn({0: "+1", 1: "+1", 2: "0"})

    def rubric_handler(request):
        return httpx.Response(
            200, json={"choices": [{"message": {"content": "Mostly right.\nFinal score: 6"}}]}
        )

    rubric = RubricJudge(
        AsyncJudgeClient(
            "http://r/v1",
            "m",
            name="rubric",
            transport=httpx.MockTransport(rubric_handler),
            metrics=judge_metrics("reward"),
        ),
        "rubric_v1",
        votes=2,
        low=0,
        high=10,
    )
    scorer = Scorer(
        "last_integer",
        {"verifier": 1.0, "outcome": 2.0, "step": 0.5, "rubric": 0.1},
        step_judge=NextStateJudge(_client(step_handler), "prm_v2", votes=1),
        rubric_judge=rubric,
    )
    s = _episode({"answer": 8, "rubric": "Answers the question directly."})
    s.rewards["outcome"] = -0.25  # posted by the environment
    asyncio.run(scorer.score(s))
    assert dict(s.rewards) == {
        "verifier": 1.0,
        "outcome": -0.25,
        "step/0": 1.0,
        "step/1": 1.0,
        "step": 1.0,
        "rubric": 6.0,
    }
    # 1.0*1.0 + 2.0*(-0.25) + 0.5*1.0 + 0.1*6.0 = 1.0 - 0.5 + 0.5 + 0.6 = 1.6
    assert s.has_reward and s.reward == pytest.approx(1.6)


def test_outcome_alone_passes_through_unchanged():
    s = _episode({})  # no answer: no verifier
    s.rewards["outcome"] = 0.7
    asyncio.run(Scorer("last_integer").score(s))
    assert s.has_reward and dict(s.rewards) == {"outcome": 0.7}
    assert s.reward == pytest.approx(0.7)


def test_rubric_needs_a_rubric_and_default_rubric_applies():
    calls = []

    def handler(request):
        calls.append(json.loads(request.content)["messages"][0]["content"])
        return httpx.Response(200, json={"choices": [{"message": {"content": "Final score: 3"}}]})

    def rubric():
        return RubricJudge(
            AsyncJudgeClient(
                "http://r/v1",
                "m",
                name="rubric",
                transport=httpx.MockTransport(handler),
                metrics=judge_metrics("reward"),
            ),
            "rubric_v1",
            votes=1,
        )

    s = asyncio.run(Scorer("last_integer", rubric_judge=rubric()).score(_episode()))
    assert "rubric" not in s.rewards and not calls
    s = asyncio.run(
        Scorer("last_integer", rubric_judge=rubric(), default_rubric="Be brief.").score(_episode())
    )
    assert s.rewards["rubric"] == 3.0 and "Be brief." in calls[0]
