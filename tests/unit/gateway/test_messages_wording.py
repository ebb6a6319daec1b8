"""A Messages request that fails validation is told in words, never pydantic's ("Value error, ",
"Input should be ...", "List should have at least ..."); a missing field keeps Anthropic's own
"<field>: Field required" (fake engine, real Redis and tokenizer)."""

import pytest

from flywheel.core.validation_messages import anthropic_message

from .test_request_rules import _client, renderer  # noqa: F401  (fixture)

U = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
PYDANTIC = ("Value error", "Input should", "List should", "after validation")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            {"max_tokens": "abc", "messages": U},
            "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
        ),
        (
            {"max_tokens": 8, "messages": []},
            "Invalid 'messages': empty array. Expected an array with minimum length 1",
        ),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [IMAGE]}]}, "block 0"),
        ({"messages": U}, "max_tokens: Field required"),
    ],
)
def test_messages_validation_errors_are_words(redis_client, prefix, renderer, body, words):
    client, engine = _client(redis_client, prefix, renderer)
    resp = client.post("/v1/messages", json={"model": "m", **body})
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    message = answer["error"]["message"]
    assert words in message, message
    assert not any(w in message for w in PYDANTIC), message
    assert engine.prompts == []


def test_anthropic_message_worked_examples():
    assert anthropic_message({"type": "missing"}, "max_tokens") == "max_tokens: Field required"
    assert (
        anthropic_message({"type": "extra_forbidden"}, "bogus")
        == "bogus: Extra inputs are not permitted"
    )
    error = {"type": "value_error", "msg": "Value error, block 0 has type 'image'"}
    assert anthropic_message(error, "messages[0].content") == (
        "messages[0].content: block 0 has type 'image'"
    )
