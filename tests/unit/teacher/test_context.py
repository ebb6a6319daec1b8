"""Teacher context: response span, hint placement, environment-provided context."""

from __future__ import annotations

import json

import pytest

from flywheel.core.codec import new_sample
from flywheel.core.errors import InvalidRequestError
from flywheel.teacher.context import (
    TeacherRenderer,
    insert_context,
    message_dicts,
    response_span,
    task_context,
    turn_context,
)

MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 7+1?"},
    {"role": "assistant", "content": "9"},
    {"role": "user", "content": "Again: 7+1?"},
    {"role": "assistant", "content": "It is 9."},
]


@pytest.mark.parametrize(
    ("mask", "span"),
    [
        ([0, 0, 1, 1, 0, 1, 1, 1], (5, 8)),  # last of two sampled segments
        ([0, 1, 1, 0], (1, 3)),  # trailing unsampled token excluded
        ([1, 1], (0, 2)),
        ([0, 0], None),
        ([], None),
    ],
)
def test_response_span_is_the_last_run_of_sampled_tokens(mask, span):
    assert response_span(mask) == span


def test_turn_context_is_everything_before_the_last_assistant_message():
    context, response = turn_context(MSGS)
    assert context == MSGS[:4] and response == "It is 9."
    with pytest.raises(InvalidRequestError):
        turn_context(MSGS[:2])


def test_hint_appended_to_the_last_user_message():
    out = insert_context(MSGS[:4], " Say only 8. ", "last_user")
    assert out[3]["content"] == "Again: 7+1?\n\n[Hindsight hint]\nSay only 8."
    assert out[:3] == MSGS[:3]
    assert MSGS[3]["content"] == "Again: 7+1?"  # the input is not modified


def test_hint_as_a_system_note():
    out = insert_context(MSGS[:4], "Say only 8.", "system_note")
    assert out[0]["content"] == "Be brief.\n\n[Hindsight hint]\nSay only 8."
    bare = insert_context(MSGS[1:4], "Say only 8.", "system_note", kind="privileged_context")
    assert bare[0] == {"role": "system", "content": "[Privileged context]\nSay only 8."}
    assert bare[1:] == MSGS[1:4]


def test_last_user_placement_needs_a_user_message():
    with pytest.raises(InvalidRequestError):
        insert_context([{"role": "system", "content": "x"}], "hint", "last_user")


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ({"answer": 8, "hint": " Give only 8. "}, ("hint", "Give only 8.")),
        (
            {"hint": "h", "privileged_context": "Solution: 7+1=8"},
            ("privileged_context", "Solution: 7+1=8"),
        ),
        ({"answer": 8}, None),
        ({"hint": ""}, None),
        ({"hint": 3}, None),
    ],
)
def test_task_context(task, expected):
    assert task_context(new_sample(task_json=json.dumps(task))) == expected
    assert task_context(new_sample(task_json="not json")) is None


def test_messages_round_trip_through_the_sample():
    sample = new_sample()
    sample.messages.add(
        role="assistant", content_json="null", extra_json=json.dumps({"tool_calls": [{"id": "c1"}]})
    )
    assert message_dicts(sample.messages) == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    ]


def test_renderer_uses_the_teacher_template_with_the_hint(tiny_model_dir):
    renderer = TeacherRenderer(tiny_model_dir)
    hinted = insert_context(MSGS[:4], "Say only 8.", "last_user")
    ids = renderer.prompt_ids(hinted)
    text = renderer.tokenizer.decode(ids)
    assert "Again: 7+1?\n\n[Hindsight hint]\nSay only 8.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # generation prompt added
