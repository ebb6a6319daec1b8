"""What the OpenAPI document says about fields whose validation is a check in code.

A request model's field validator (a tool must be a function, a tool message needs its
`tool_call_id`, a penalty must keep its neutral value, ...) is invisible to FastAPI's schema
generator, which would document a looser type (`dict`, `Any`) than the route accepts. These JSON
schemas state the same rules, so a generated client or a schema fuzzer only builds requests the
gateway serves. Each is attached to its field with `WithJsonSchema` (or to its model as
`json_schema_extra`) next to the check it documents. Where a rule compares two fields (two
caps that must agree, a request's `best_of` and `n`), the schema documents a subset of what is
valid (every request it describes is served).

`document_limits` adds what depends on the deployment (the context window, the tokenizer's
vocabulary, the security limits, the served model names) to the generated document.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, StrictFloat, WithJsonSchema
from pydantic_core import PydanticCustomError

NULL: dict[str, Any] = {"type": "null"}


def integer(value: Any) -> Any:
    """A JSON integer as is; a string ("10") or a boolean is refused as the wrong type, where
    pydantic's lax mode would read them as 10 and 1 (the document says `integer`, as OpenAI's
    and Anthropic's APIs do). A decimal with no fraction (10.0) is a JSON Schema integer and
    passes.

    Raises:
        PydanticCustomError: `int_type` (worded "expected an integer, but got a string instead"
            by core/validation_messages.py).
    """
    if isinstance(value, str | bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


Int = Annotated[int, BeforeValidator(integer)]
"""An integer without bounds (a list's item): JSON integers only (see `integer`). A field with
bounds (`Field(ge=1)`) stays `int` and names itself in its model's `mode="before"` validator
that calls `integer`: bounds after a `BeforeValidator` would not reach the document as
`minimum`/`maximum`."""

Number = StrictFloat
"""A JSON number, integer or decimal (1 reads as 1.0): a string ("0.5") or a boolean is refused
as the wrong type (`float_type`, "expected a decimal, but got a string instead"), where pydantic's
lax mode would read them as 0.5 and 1.0. Bounds (`Field(ge=0)`) keep their place in the document
as `minimum`/`maximum`."""


def str_or_list(value: Any) -> str | None:
    """The branch of a "string or array" field a value takes (a `Discriminator`'s tag): "str",
    "list", or None for neither, so the error is the field's one message naming both."""
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or JSON null."""
    return {"anyOf": [schema, NULL]}


def neutral(*values: Any) -> WithJsonSchema:
    """A field accepted only with one of its neutral `values` (or null): the engine cannot honour
    any other, so the request model refuses it."""
    shapes: list[dict[str, Any]] = []
    for v in values:
        if isinstance(v, dict):
            shapes.append({"type": "object", "maxProperties": 0})
        elif isinstance(v, list):
            shapes.append({"type": "array", "maxItems": 0})
        else:
            shapes.append({"const": v})
    return WithJsonSchema({"anyOf": [*shapes, NULL]})


ONLY_NULL = WithJsonSchema(NULL)
"""A field the gateway accepts only as null or absent."""

TOP_K_MAX = 2**31 - 1
"""Largest `top_k` accepted: the Sample records it as an int32 (proto/flywheel/v1/sample.proto)."""

TOP_K = WithJsonSchema(
    nullable({"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": TOP_K_MAX}]}),
)
"""SGLang's `top_k`: -1 (the whole vocabulary) or a positive integer up to `TOP_K_MAX`."""

TEXT_PART: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "input_text", "output_text"]},
        "text": {"type": "string"},
    },
    "required": ["type", "text"],
}
REFUSAL_PART: dict[str, Any] = {
    "type": "object",
    "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
    "required": ["type", "refusal"],
}
CONTENT: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [TEXT_PART, REFUSAL_PART]}},
    ]
}
"""A message's content: text, or text / refusal parts (the model reads text only)."""

TOOL_CALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}, NULL]},
            },
            "required": ["name"],
        },
    },
    "required": ["function"],
}


def _message(role: str, **fields: dict[str, Any]) -> dict[str, Any]:
    """A message of `role` whose `fields` are all required (besides an optional `name`)."""
    return {
        "type": "object",
        "properties": {"role": {"const": role}, "name": {"type": "string"}, **fields},
        "required": ["role", *fields],
    }


CHAT_MESSAGE: dict[str, Any] = {
    "anyOf": [
        _message("system", content=CONTENT),
        _message("developer", content=CONTENT),
        _message("user", content=CONTENT),
        {  # assistant with content (tool calls optional)
            "type": "object",
            "properties": {
                "role": {"const": "assistant"},
                "content": CONTENT,
                "tool_calls": {"type": "array", "items": TOOL_CALL},
            },
            "required": ["role", "content"],
        },
        {  # assistant with tool calls (content optional, may be null)
            "type": "object",
            "properties": {
                "role": {"const": "assistant"},
                "content": nullable(CONTENT),
                "tool_calls": {"type": "array", "items": TOOL_CALL, "minItems": 1},
            },
            "required": ["role", "tool_calls"],
        },
        _message("tool", content=CONTENT, tool_call_id={"type": "string"}),
    ]
}
"""One chat message, by role: content is required except on an assistant message with tool
calls; a tool message needs the `tool_call_id` it answers (OpenAI's rules, request_rules.py)."""

CHAT_MESSAGES = WithJsonSchema({"type": "array", "items": CHAT_MESSAGE, "minItems": 1})

NEXT_STATE = WithJsonSchema(
    nullable(
        {
            "type": "object",
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": nullable(CONTENT),
                "tool_calls": nullable({"type": "array", "items": TOOL_CALL}),
                "tool_call_id": nullable({"type": "string"}),
            },
            "required": ["role"],
        }
    )
)
"""A live session's next state (finish body): a message whose content may be null and whose
tool result may leave out `tool_call_id`."""

FUNCTION_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": nullable({"type": "object"}),
                "strict": nullable({"type": "boolean"}),
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
TOOLS = WithJsonSchema(nullable({"type": "array", "items": FUNCTION_TOOL, "maxItems": 128}))

TOOL_CHOICE = WithJsonSchema(
    nullable(
        {
            "anyOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}},
                            "required": ["name"],
                        },
                    },
                    "required": ["type", "function"],
                },
            ]
        }
    )
)
"""`tool_choice`; "required" or a named function forces a call, which needs `tools` holding that
function (constraints.py)."""

PLAIN_FORMAT: dict[str, Any] = {
    "type": "object",
    "properties": {"type": {"enum": ["text", "json_object"]}},
    "required": ["type"],
}
"""A reply format without a schema: chat `response_format` and Responses `text.format`."""

RESPONSE_FORMAT = WithJsonSchema(
    nullable(
        {
            "anyOf": [
                PLAIN_FORMAT,
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "json_schema"},
                        "json_schema": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": nullable({"type": "boolean"}),
                            },
                        },
                    },
                    "required": ["type", "json_schema"],
                },
            ]
        }
    )
)
"""`response_format`: text, json_object, or json_schema with its schema object."""

STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "stream_options": {"properties": {"stream": {"const": True}}, "required": ["stream"]}
}
"""`dependentSchemas`: `stream_options` only with `stream: true` (as OpenAI's API)."""


TEXT_CONTENT: dict[str, Any] = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}],
}
"""Text, or text parts only (no refusal parts)."""


def _item(kind: str, **fields: dict[str, Any]) -> dict[str, Any]:
    """A Responses input item of type `kind` whose `fields` are all required."""
    return {
        "type": "object",
        "properties": {"type": {"const": kind}, **fields},
        "required": ["type", *fields],
    }


def _input_message(roles: list[str], content: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"type": {"const": "message"}, "role": {"enum": roles}, "content": content},
        "required": ["role", "content"],
    }


RESPONSES_INPUT = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "minItems": 1,
                "items": {
                    "anyOf": [
                        _input_message(["user", "system", "developer"], TEXT_CONTENT),
                        _input_message(["assistant"], CONTENT),
                        _item(
                            "function_call",
                            call_id={"type": "string"},
                            name={"type": "string"},
                            arguments={"type": "string"},
                        ),
                        _item(
                            "function_call_output", call_id={"type": "string"}, output=TEXT_CONTENT
                        ),
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "reasoning"},
                                "summary": {"type": "array", "items": {"type": "object"}},
                                "content": nullable({"type": "array", "items": {"type": "object"}}),
                                "encrypted_content": nullable({"type": "string"}),
                            },
                            "required": ["type"],
                        },
                    ]
                },
            },
        ]
    }
)
"""Responses `input`: a user message's text, or items (messages, function_call,
function_call_output, reasoning; responses_translate.py). Required: a request continuing a stored
response (`previous_response_id`) still brings its new input."""

RESPONSES_TOOLS = WithJsonSchema(
    nullable(
        {
            "type": "array",
            "maxItems": 128,
            "items": {
                "type": "object",
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string"},
                    "description": nullable({"type": "string"}),
                    "parameters": nullable({"type": "object"}),
                    "strict": nullable({"type": "boolean"}),
                },
                "required": ["type", "name"],
            },
        }
    )
)
"""Function tools only (the gateway runs no built-in tool)."""

RESPONSES_TOOL_CHOICE = WithJsonSchema(
    nullable(
        {
            "anyOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                    "required": ["type", "name"],
                },
            ]
        }
    )
)

RESPONSES_TEXT = WithJsonSchema(
    nullable(
        {
            "type": "object",
            "properties": {
                "format": {
                    "anyOf": [
                        PLAIN_FORMAT,
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "json_schema"},
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": nullable({"type": "boolean"}),
                            },
                            "required": ["type", "schema"],
                        },
                    ]
                },
                "verbosity": nullable({"enum": ["low", "medium", "high"]}),
            },
        }
    )
)
"""`text`: its `format` becomes the chat turn's `response_format`."""

FORCED_CALL_NEEDS_TOOLS: dict[str, Any] = {
    "tool_choice": {
        "required": ["tools"],
        "properties": {"tools": {"type": "array", "minItems": 1}},
    }
}
"""`dependentSchemas`: a `tool_choice` comes with the tools it chooses among (a forced call
needs them; documented for every value)."""


def _block(kind: str, required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic content block of type `kind` (no other keys: the model forbids them)."""
    return {
        "type": "object",
        "properties": {
            "type": {"const": kind},
            **required,
            **optional,
            "cache_control": nullable({"type": "object"}),
        },
        "required": ["type", *required],
        "additionalProperties": False,
    }


TEXT_BLOCK = _block(
    "text",
    {"text": {"type": "string"}},
    {"citations": nullable({"type": "array", "items": {"type": "object"}})},
)
TOOL_USE_BLOCK = _block(
    "tool_use",
    {"id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"}},
    {"caller": nullable({"type": "object"}), "toolset_name": nullable({"type": "string"})},
)
TOOL_RESULT_BLOCK = _block(
    "tool_result",
    {"tool_use_id": {"type": "string"}},
    {
        "content": nullable(
            {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]}
        ),
        "is_error": {"type": "boolean"},
        "toolset_name": nullable({"type": "string"}),
    },
)
THINKING_BLOCK = _block(
    "thinking", {"thinking": {"type": "string"}}, {"signature": {"type": "string"}}
)


def _anthropic_message(role: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "role": {"const": role},
            "content": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": blocks}}]
            },
        },
        "required": ["role", "content"],
        "additionalProperties": False,
    }


ANTHROPIC_MESSAGES = WithJsonSchema(
    {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                _anthropic_message("user", [TEXT_BLOCK, TOOL_RESULT_BLOCK]),
                _anthropic_message("assistant", [TEXT_BLOCK, TOOL_USE_BLOCK, THINKING_BLOCK]),
            ]
        },
        "description": "The conversation; it ends with a user message (a trailing assistant "
        "message, a prefill, is refused).",
    }
)
"""Anthropic `messages`: user messages hold text and tool_result blocks, assistant messages
text, tool_use and thinking blocks (messages_convert.py)."""


def _find(doc: dict[str, Any], model: str) -> dict[str, Any]:
    return dict(doc.get("components", {}).get("schemas", {}).get(model, {}).get("properties", {}))


def _set_bound(prop: dict[str, Any], key: str, value: int) -> None:
    """Set `key` (maximum, maxItems) on the non-null branches of a property schema."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("integer", "array"):
            branch[key] = value


def document_limits(
    doc: dict[str, Any],
    *,
    context_length: int,
    vocab_size: int,
    max_messages: int,
    max_tools: int,
    served_models: list[str],
) -> dict[str, Any]:
    """Add the deployment's limits to a generated OpenAPI document (in place; returned).

    Args:
        doc: FastAPI's OpenAPI dict.
        context_length: the engine's window in tokens; a completion cap of the window or more
            can never fit (at least one prompt token), so caps are documented below it.
        vocab_size: token ids of a text completion's id prompt are in [0, vocab_size).
        max_messages, max_tools: `gateway.security` limits of a chat request.
        served_models: `gateway.served_model_names` (empty: any model name is served).
    """
    cap = max(1, context_length - 1)
    for model in (
        "ChatCompletionRequest",
        "CompletionRequest",
        "ResponsesRequest",
        "MessagesRequest",
    ):
        props = _find(doc, model)
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in props:
                _set_bound(props[field], "maximum", cap)
        if served_models and "model" in props:
            props["model"]["enum"] = ["", *served_models]
    chat = _find(doc, "ChatCompletionRequest")
    if "messages" in chat:
        chat["messages"]["maxItems"] = max_messages
    if "tools" in chat:
        _set_bound(chat["tools"], "maxItems", min(128, max_tools))
    prompt = _find(doc, "CompletionRequest").get("prompt", {})
    for branch in prompt.get("anyOf", []):
        items = branch.get("items", {})
        for ids in (items, items.get("items", {})):
            if ids.get("type") == "integer":
                ids.update(minimum=0, maximum=vocab_size - 1)
    return doc
