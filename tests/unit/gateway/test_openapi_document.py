"""The OpenAPI document says what the routes accept: for each body below, the document's JSON
schema (checked with `jsonschema`) and the route (a 200 or a 400 from the app with a canned
engine) give the same verdict; the deployment's limits are in the document; every path
parameter is declared."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app
from .test_app import FakeEngine

USER = {"role": "user", "content": "7 + 1?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = [
    ({"model": "m", "messages": [USER]}, True),
    ({"messages": [USER]}, False),  # OpenAI requires `model`
    ({"model": "m", "messages": []}, False),
    ({"model": "m", "messages": [{"role": "tool", "content": "3"}]}, False),  # no tool_call_id
    ({"model": "m", "messages": [USER, {"role": "assistant", "content": None}, USER]}, False),
    (
        {
            "model": "m",
            "messages": [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ],
        },
        True,
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        True,
    ),
    (
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        False,
    ),
    ({"model": "m", "messages": [USER], "frequency_penalty": 0}, True),
    ({"model": "m", "messages": [USER], "frequency_penalty": 0.5}, False),
    ({"model": "m", "messages": [USER], "logit_bias": {"5": 1.0}}, False),
    ({"model": "m", "messages": [USER], "stream_options": {"include_usage": True}}, False),
    ({"model": "m", "messages": [USER], "top_k": 0}, False),
    ({"model": "m", "messages": [USER], "top_k": -1}, True),
    ({"model": "m", "messages": [USER], "top_k": 2**31 - 1}, True),
    ({"model": "m", "messages": [USER], "top_k": 2**31}, False),  # recorded as int32
    ({"model": "m", "messages": [USER], "tool_choice": "required"}, False),  # no tools to call
    ({"model": "m", "messages": [USER], "tools": [{"type": "function"}]}, False),
    ({"model": "m", "messages": [USER], "tools": [TOOL], "tool_choice": "auto"}, True),
    ({"model": "m", "messages": [USER], "top_logprobs": 3}, False),  # needs logprobs: true
    ({"model": "m", "messages": [USER], "response_format": {"type": "xml"}}, False),
    ({"model": "m", "messages": [USER], "max_tokens": 2000}, True),
    ({"model": "m", "messages": [USER], "max_tokens": 2048}, False),  # the window is 2048 tokens
    ({"model": "m", "messages": [USER], "max_tokens": "10"}, False),  # integers are strict
    ({"model": "m", "messages": [USER], "max_tokens": True}, False),
    ({"model": "m", "messages": [USER], "n": "1"}, False),
    ({"model": "m", "messages": [USER], "min_tokens": False}, False),  # neutral 0, not false
    ({"model": "m", "messages": [USER], "temperature": 1}, True),
    ({"model": "m", "messages": [USER], "temperature": 0.5}, True),
    ({"model": "m", "messages": [USER], "temperature": "0.5"}, False),  # numbers are strict
    ({"model": "m", "messages": [USER], "top_p": True}, False),
    ({"model": "m", "messages": [USER], "frequency_penalty": "0"}, False),
    ({"model": "m", "messages": [USER], "presence_penalty": False}, False),
    ({"model": "m", "messages": [USER], "stop": ["a", "b", "c", "d"]}, True),
    ({"model": "m", "messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, False),  # OpenAI: 4
]
COMPLETIONS = [
    ({"model": "m", "prompt": "7 + 1 ="}, True),
    ({"prompt": "7 + 1 ="}, False),
    ({"model": "m", "prompt": []}, False),
    ({"model": "m", "prompt": [[]]}, False),
    ({"model": "m", "prompt": [1, 2, 3]}, True),
    ({"model": "m", "prompt": [1, 2, 10**6]}, False),  # beyond the vocabulary
    ({"model": "m", "prompt": "a", "best_of": 2}, False),
    ({"model": "m", "prompt": "a", "echo": True}, False),
    ({"model": "m", "prompt": "a", "max_tokens": "4"}, False),
    ({"model": "m", "prompt": [1, True]}, False),
    ({"model": "m", "prompt": "a", "temperature": "0.5"}, False),
    ({"model": "m", "prompt": "a", "top_p": 1}, True),
]


@pytest.fixture(scope="module")
def app_and_doc(smollm2_dir, redis_server):
    from flywheel.core.redis_client import connect

    renderer = ChatRenderer(smollm2_dir)
    client, _, _ = gateway_app(
        connect(redis_server.url), "openapi-doc", renderer, FakeEngine(renderer)
    )
    return client, client.get("/openapi.json").json()


def _validator(doc: dict, model: str) -> Draft202012Validator:
    return Draft202012Validator(
        {"$ref": f"#/components/schemas/{model}", "components": doc["components"]}
    )


@pytest.mark.parametrize(("body", "valid"), CHAT)
def test_chat_schema_and_route_agree(app_and_doc, body, valid):
    client, doc = app_and_doc
    assert _validator(doc, "ChatCompletionRequest").is_valid(body) is valid
    status = client.post("/v1/chat/completions", json={"max_tokens": 4, **body}).status_code
    assert status == (200 if valid else 400), body


@pytest.mark.parametrize(("body", "valid"), COMPLETIONS)
def test_completion_schema_and_route_agree(app_and_doc, body, valid):
    client, doc = app_and_doc
    assert _validator(doc, "CompletionRequest").is_valid(body) is valid
    status = client.post("/v1/completions", json={"max_tokens": 4, **body}).status_code
    assert status == (200 if valid else 400), body


def test_model_is_required_on_the_openai_routes(app_and_doc):
    _, doc = app_and_doc
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):
        assert "model" in schemas[name]["required"], name
    assert set(schemas["ResponsesRequest"]["required"]) == {"model", "input"}
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert "#/components/schemas/ResponsesRequest" in str(body["schema"])


def test_document_declares_every_path_parameter_and_the_limits(app_and_doc):
    _, doc = app_and_doc
    for path, ops in doc["paths"].items():
        names = {part[1:-1] for part in path.split("/") if part.startswith("{")}
        for method, op in ops.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert names == declared, f"{method.upper()} {path}"
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    # A cap of the whole window never fits (the prompt has at least one token): 2048 - 1.
    assert {"type": "integer", "minimum": 1, "maximum": 2047} in chat["max_tokens"]["anyOf"]
    assert chat["messages"]["maxItems"] == 1024  # gateway.security.max_messages


def test_decimal_fields_are_documented_as_numbers(app_and_doc):
    _, doc = app_and_doc
    schemas = doc["components"]["schemas"]
    for name, fields in [
        ("ChatCompletionRequest", ("temperature", "top_p", "min_p")),
        ("CompletionRequest", ("temperature", "top_p", "min_p")),
        ("ResponsesRequest", ("temperature", "top_p", "min_p")),
        ("MessagesRequest", ("temperature", "top_p")),
    ]:
        for field in fields:
            types = [s.get("type") for s in schemas[name]["properties"][field]["anyOf"]]
            assert types == ["number", "null"], (name, field, types)
