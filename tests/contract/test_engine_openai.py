"""SGLang's OpenAI-compatible routes on the engine, through a real process and the openai SDK.

Shapes follow docs/engine-protocol.md: chat.completion with `matched_stop` and
`metadata.weight_version`, chat chunks (role chunk, content deltas, finish chunk, usage chunk,
[DONE]), legacy completions logprobs, /v1/models cards, and the OpenAI error envelope
`{"object":"error","message","type","param","code"}`.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smol(smollm2_engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_engine}/v1", api_key="local", max_retries=0)


@pytest.fixture(scope="module")
def tiny(shared_live_engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_live_engine}/v1", api_key="local", max_retries=0)


def test_chat_completion_with_the_real_model_uses_its_chat_template(smol, smollm2_engine):
    messages = [{"role": "user", "content": "What is 2+3?"}]
    out = smol.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
    )
    choice = out.choices[0]
    assert "5" in choice.message.content  # the model answers "2 + 3 = 5" under its template
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == 2  # <|im_end|>, the template's end of turn
    assert out.model == "SmolLM2-135M-Instruct" and out.object == "chat.completion"
    assert out.to_dict()["metadata"] == {"weight_version": "default"}
    # the same ids the native API gives for the rendered template: prompt counts agree
    rendered = httpx.post(
        f"{smollm2_engine}/generate",
        json={
            "text": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
            "<|im_start|>assistant\n",
            "sampling_params": {"max_new_tokens": 24, "temperature": 0},
        },
    ).json()
    assert out.usage.prompt_tokens == rendered["meta_info"]["prompt_tokens"]
    assert choice.message.content == rendered["text"]
    assert out.usage.completion_tokens == len(rendered["output_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # logprobs: one entry per completion token (the stop token included), top-2 each
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    assert bytes(content[0].bytes).decode() == content[0].token


def test_chat_streaming_matches_non_streaming(tiny):
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "max_tokens": 6,
    }
    full = tiny.chat.completions.create(**kwargs)
    chunks = list(
        tiny.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == full.choices[0].message.content
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # token by token, not one final blob
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_max_completion_tokens_wins_and_length_is_reported(tiny):
    out = tiny.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "count"}],
        temperature=0,
        max_tokens=9,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].model_extra["matched_stop"] is None


def test_chat_n_and_token_ids_extension(tiny):
    out = tiny.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        n=2,
        max_tokens=4,
        seed=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    first = out.choices[0].model_extra
    assert len(first["response_token_ids"]) == 4
    assert out.usage.prompt_tokens == len(first["prompt_token_ids"])  # counted once for n=2


def test_completions_text_and_token_prompts_with_legacy_logprobs(tiny):
    out = tiny.completions.create(
        model="m",
        prompt=[[1, 504, 3458], [1, 28]],
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 2 and out.object == "text_completion"
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    default = tiny.completions.create(
        model="m", prompt="Hello", temperature=0, extra_body={"ignore_eos": True}
    )
    assert default.usage.completion_tokens == 16  # SGLang's max_tokens default
    echo = tiny.completions.create(
        model="m", prompt="Hello world", max_tokens=2, temperature=0, echo=True, logprobs=0
    )
    assert echo.choices[0].text.startswith("Hello world")
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # first prompt token: null


def test_completions_stream(tiny):
    kwargs = {
        "model": "m",
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = tiny.completions.create(**kwargs)
    chunks = list(tiny.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_errors(tiny, shared_live_engine):
    models = tiny.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    card = models.data[0]
    assert card.owned_by == "sglang" and card.model_extra["max_model_len"] == 512
    with pytest.raises(openai.BadRequestError) as e:
        tiny.chat.completions.create(model="m", messages=[])
    assert e.value.body is not None
    r = httpx.post(
        f"{shared_live_engine}/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "presence_penalty": 0.5,
        },
    )
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"object", "message", "type", "param", "code"}
    assert (
        body["object"] == "error" and body["code"] == 400 and "presence_penalty" in body["message"]
    )
    r = httpx.post(
        f"{shared_live_engine}/v1/chat/completions",
        content=json.dumps({"messages": [{"role": "user", "content": "x"}]}),
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 400 and r.json()["object"] == "error"
    r = httpx.get(f"{shared_live_engine}/v1/models/nope")
    assert r.status_code == 404 and r.json()["type"] == "model_not_found"


def test_tokenize_matches_the_chat_prompt_and_detokenize_inverts(tiny, shared_live_engine):
    msgs = [{"role": "user", "content": "hi"}]
    toks = httpx.post(f"{shared_live_engine}/v1/tokenize", json={"messages": msgs}).json()
    out = tiny.chat.completions.create(model="m", messages=msgs, max_tokens=1)
    assert toks["count"] == len(toks["tokens"]) == out.usage.prompt_tokens
    assert toks["max_model_len"] == 512
    plain = httpx.post(f"{shared_live_engine}/tokenize", json={"prompt": "Hello world"}).json()
    text = httpx.post(
        f"{shared_live_engine}/v1/detokenize", json={"tokens": plain["tokens"]}
    ).json()["text"]
    assert text == "Hello world"
