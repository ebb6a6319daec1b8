"""Hint replies are parsed strictly; votes are reduced by the configured selection rule."""

from __future__ import annotations

import json

import httpx
import pytest

from flywheel.core.codec import new_sample
from flywheel.core.judge_client import JudgeClient, judge_metrics
from flywheel.teacher.hints import HintExtractor, HintVote, parse_hint_reply, select_hint

HINT = "Answer with only the number 8."
OK = f"The user says the answer is wrong.\n[HINT_START]\n{HINT}\n[HINT_END]\nDecision: \\boxed{{1}}"


@pytest.mark.parametrize(
    ("reply", "decision", "hint", "reason"),
    [
        (OK, 1, HINT, "ok"),  # valid
        (f"[HINT_START]{HINT}[HINT_END]\n**Decision: \\boxed{{+1}}**", 1, HINT, "ok"),  # markdown
        ("Nothing to fix.\nDecision: \\boxed{-1}", -1, "", "ok"),  # valid no-hint
        (f"[HINT_START]{HINT}[HINT_END]\nDecision: \\boxed{{-1}}", -1, "", "ok"),  # block ignored
        (f"{HINT}\nDecision: \\boxed{{1}}", None, "", "missing markers"),  # no markers
        (f"[HINT_START]{HINT}\nDecision: \\boxed{{1}}", None, "", "missing markers"),  # unclosed
        (f"[HINT_END]{HINT}[HINT_START]\nDecision: \\boxed{{1}}", None, "", "missing markers"),
        ("[HINT_START]   \n [HINT_END]\nDecision: \\boxed{1}", None, "", "empty hint"),  # empty
        ("[HINT_START]Be nice[HINT_END]\nDecision: \\boxed{1}", None, "", "shorter"),  # too short
        (
            f"[HINT_START]{HINT}[HINT_END] [HINT_START]Say 9 instead.[HINT_END]\n"
            "Decision: \\boxed{1}",
            None,
            "",
            "multiple hint blocks",
        ),  # multiple
        (f"[HINT_START]{HINT}[HINT_END]", None, "", "last line"),  # no decision
        (f"Decision: \\boxed{{1}}\n[HINT_START]{HINT}[HINT_END]", None, "", "last line"),
        ("Decision: \\boxed{2}", None, "", "not 1 or -1"),  # out of set
        ("", None, "", "empty reply"),  # empty reply
    ],
)
def test_parse_hint_reply_table(reply, decision, hint, reason):
    vote = parse_hint_reply(reply, min_chars=10)
    assert (vote.decision, vote.hint) == (decision, hint)
    assert reason in vote.reason


def V(decision, hint=""):
    return HintVote(decision, hint, "ok" if decision is not None else "parse: x")


A, B, C = "Use the metric system.", "Reply in French, please.", "Give only the final number."


@pytest.mark.parametrize(
    ("votes", "rule", "expected"),
    [
        ([V(1, A), V(1, C), V(-1)], "longest", C),  # len(C) = 27 > len(A) = 22
        ([V(1, A), V(-1), V(-1)], "longest", A),  # one hint suffices for longest
        ([V(-1), V(None), V(-1)], "longest", ""),  # no hint at all
        ([V(1, A), V(1, A.upper()), V(1, C)], "most_agreed", A),  # 2 votes agree (case-folded)
        ([V(1, A), V(1, C), V(1, B)], "most_agreed", C),  # all tied at 1: longest of the tied
        ([V(1, A), V(-1), V(-1)], "most_agreed", ""),  # 1 of 3 valid: no majority for a hint
        ([V(1, A), V(-1)], "most_agreed", ""),  # 1 of 2: a tie is not a majority
        ([V(1, A), V(None), V(None)], "most_agreed", A),  # 1 of 1 valid decision
        ([V(1, A), V(1, A)], "none", ""),  # rule none: never a hint
    ],
)
def test_select_hint(votes, rule, expected):
    assert select_hint(votes, rule) == expected


def _turn(next_state: str | None = "No, 7 + 1 is 8. Just give the number."):
    sample = new_sample(session_id="s1", mode="live")
    for role, content in [("user", "What is 7 + 1?"), ("assistant", "It is 9.")]:
        sample.messages.add(role=role, content_json=json.dumps(content))
    if next_state is not None:
        sample.next_state.role = "user"
        sample.next_state.content_json = json.dumps(next_state)
    return sample


class Judge:
    def __init__(self, *replies):
        self.replies = list(replies)
        self.prompts: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.prompts.append(json.loads(request.content)["messages"][0]["content"])
        reply = self.replies.pop(0)
        if isinstance(reply, int):
            return httpx.Response(reply)
        return httpx.Response(200, json={"choices": [{"message": {"content": reply}}]})


def _extractor(judge: Judge, votes: int, rule: str = "longest") -> HintExtractor:
    client = JudgeClient(
        "http://judge/v1",
        "m",
        max_attempts=1,
        backoff_s=0,
        transport=httpx.MockTransport(judge),
        metrics=judge_metrics("teacher"),
    )
    return HintExtractor(client, votes=votes, selection=rule)


def test_extractor_votes_and_selects_the_longest_valid_hint():
    judge = Judge(
        OK,
        "Decision: \\boxed{-1}",
        f"[HINT_START]{C} Nothing else.[HINT_END]\nDecision: \\boxed{{1}}",
    )
    result = _extractor(judge, votes=3).extract(_turn())
    assert result.status == "hint" and result.hint == f"{C} Nothing else."
    assert len(judge.prompts) == 3
    prompt = judge.prompts[0]
    assert "What is 7 + 1?" in prompt and "It is 9." in prompt and "Just give the number" in prompt


def test_no_valid_vote_is_unjudged_and_no_hint_votes_are_no_hint():
    assert _extractor(Judge("garbage", 500), votes=2).extract(_turn()).status == "unjudged"
    result = _extractor(Judge("Decision: \\boxed{-1}", "junk"), votes=2).extract(_turn())
    assert (result.status, result.hint) == ("no_hint", "")
    assert [v.decision for v in result.votes] == [-1, None]


def test_a_turn_without_next_state_is_not_judged():
    judge = Judge()
    assert _extractor(judge, votes=2).extract(_turn(None)).status == "no_next_state"
    assert judge.prompts == []
