"""OpenAI request -> native sampling params, and response shapes (torch-free)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel.engine.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    finish,
    usage,
)

MSG = [{"role": "user", "content": "hi"}]


def test_chat_uses_generation_config_defaults_only_where_the_request_is_null():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    p = ChatCompletionRequest(messages=MSG).sampling(defaults, None)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 50)
    p = ChatCompletionRequest(messages=MSG, temperature=0, top_k=-1).sampling(defaults, None)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.9, -1)
    assert p.max_new_tokens is None  # null max_tokens = up to the context length


def test_max_completion_tokens_wins_over_max_tokens():
    assert ChatCompletionRequest(messages=MSG, max_tokens=9).new_tokens() == 9
    req = ChatCompletionRequest(messages=MSG, max_tokens=9, max_completion_tokens=3)
    assert req.new_tokens() == 3


def test_completions_defaults_and_prompt_forms():
    req = CompletionRequest(prompt="x")
    p = req.sampling({}, req.max_tokens)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, -1)
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": MSG, "tools": [{"type": "function"}], "tool_choice": "required"},
        {"messages": MSG, "response_format": {"type": "xml"}},
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
        {"messages": MSG, "stream": True, "return_token_ids": True},
    ],
)
def test_requests_the_engine_cannot_honour_are_refused(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_unsupported_penalties_fail_when_converted():
    with pytest.raises(ValidationError, match="presence_penalty"):
        ChatCompletionRequest(messages=MSG, presence_penalty=0.5).sampling({}, None)


META = {
    "id": "r",
    "prompt_tokens": 5,
    "completion_tokens": 2,
    "finish_reason": {"type": "stop", "matched": 2},
    "output_token_logprobs": [[-0.25, 17, "Hi"], [None, 2, "<|im_end|>"]],
    "output_top_logprobs": [[[-0.25, 17, "Hi"], [-1.5, 18, "Hey"]], [[None, 2, "<|im_end|>"]]],
    "input_token_logprobs": [[None, 1, "<s>"], [-3.0, 9, " a"]],
    "input_top_logprobs": [None, [[-3.0, 9, " a"]]],
}


def test_chat_logprobs_shape_and_null_becomes_a_number():
    content = chat_logprobs(META)["content"]
    assert content[0] == {
        "token": "Hi",
        "bytes": [72, 105],
        "logprob": -0.25,
        "top_logprobs": [
            {"token": "Hi", "bytes": [72, 105], "logprob": -0.25},
            {"token": "Hey", "bytes": [72, 101, 121], "logprob": -1.5},
        ],
    }
    assert content[1]["logprob"] == -9999.0  # OpenAI's logprob is a number, never null
    assert chat_logprobs(META, start=1)["content"] == content[1:]


def test_completion_logprobs_with_echo_prepend_prompt_rows():
    lp = completion_logprobs(META, echo=True)
    assert lp["tokens"] == ["<s>", " a", "Hi", "<|im_end|>"]
    assert lp["token_logprobs"] == [None, -3.0, -0.25, None]
    assert lp["text_offset"] == [0, 3, 5, 7]  # 3 = len("<s>"), 5 = 3 + len(" a"), 7 = 5 + 2
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"Hi": -0.25, "Hey": -1.5}


def test_finish_and_usage():
    assert finish(META) == ("stop", 2)
    assert finish({"finish_reason": {"type": "length", "length": 4}}) == ("length", None)
    results = [{"meta_info": META}, {"meta_info": META}]
    # n = 2 copies of one prompt: prompt tokens counted once (5), completions summed (2 + 2)
    assert usage(results, 2)["prompt_tokens"] == 5 and usage(results, 2)["total_tokens"] == 9
