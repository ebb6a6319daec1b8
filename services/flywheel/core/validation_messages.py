"""OpenAI's wording for a request that fails validation, from one pydantic error.

`openai_message(error, param)` turns a pydantic error (`ValidationError.errors()` item) about
the body field `param` (OpenAI's form, "messages[0].role") into the sentence OpenAI's API answers
for it, e.g. {"type": "int_parsing", "input": "abc"} for max_tokens -> "Invalid type for
'max_tokens': expected an integer, but got a string instead." Error types it does not know keep
pydantic's sentence after the field (`"<param>: <msg>"`, without pydantic's "Value error, "), as
do validators' own messages (one that starts with the field's name is given as it is).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a decimal",
    "float_parsing": "a decimal",
    "decimal_type": "a decimal",
    "decimal_parsing": "a decimal",
    "string_type": "a string",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "an array",
    "tuple_type": "an array",
    "set_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dataclass_type": "an object",
}
"""pydantic's type error -> the JSON type OpenAI names as expected."""

BOUNDS = {
    "greater_than_equal": ("below minimum", ">=", "ge"),
    "greater_than": ("below minimum", ">", "gt"),
    "less_than_equal": ("above maximum", "<=", "le"),
    "less_than": ("above maximum", "<", "lt"),
}
"""pydantic's bound error -> (OpenAI's words, the comparison, the bound's key in `ctx`)."""


BODY_NOT_OBJECT = "the request body must be a JSON object"
"""The message for a request without a body (or a null one)."""


def json_type(value: Any) -> str:
    """The JSON type of a decoded value in OpenAI's words: "a string", "an integer", "a decimal",
    "a boolean", "an array", "an object" or "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    return "an object"


def shown(value: Any) -> str:
    """A value as the request wrote it (JSON), cut to 60 characters: a message shows a client's
    value so, never as a Python repr. Example: {"type": "any"} -> '{"type": "any"}'."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def quoted(value: Any) -> str:
    """A client's value in a message: a string in single quotes, anything else as JSON (`shown`).
    Examples: "image" -> "'image'", {"a": 1} -> '{"a": 1}'."""
    return f"'{value}'" if isinstance(value, str) else shown(value)


def one_of(values: Any) -> str:
    """Names in words, each quoted: ["a", "b", "c"] -> "'a', 'b' or 'c'"."""
    names = [f"'{v}'" for v in values]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _number(value: Any) -> str:
    """A bound or input number as JSON writes it: 2.0 -> "2", 0.5 -> "0.5"; a query parameter's
    text as it was written ("0" -> "0")."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        return value
    return shown(value)


def openai_message(error: Mapping[str, Any], param: str | None) -> str:
    """OpenAI's message for the pydantic `error` about body field `param` (None: the body).

    Examples (param "max_tokens" unless said):
        int_parsing, input "abc" -> "Invalid type for 'max_tokens': expected an integer, but
            got a string instead."
        missing (param "messages[0].role") -> "Missing required parameter: 'messages[0].role'."
        extra_forbidden (param "bogus") -> "Unrecognized request argument supplied: bogus"
        less_than_equal, ctx le 2, input 2.5 (param "temperature") -> "Invalid 'temperature':
            decimal above maximum value. Expected a value <= 2, but got 2.5 instead." (an integer
            input: "number above maximum value")
        literal_error, input "wizard", ctx expected "'user' or 'tool'" (param
            "messages[0].role") -> "Invalid value: 'wizard'. Supported values are: 'user' or
            'tool'."
    """
    kind = str(error.get("type", ""))
    value = error.get("input")
    ctx = error.get("ctx") or {}
    name = param or "body"
    msg = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
    if kind == "missing" and param is None:
        return BODY_NOT_OBJECT
    if kind == "missing":
        return f"Missing required parameter: '{name}'."
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {name}"
    if kind in EXPECTED:
        return (
            f"Invalid type for '{name}': expected {EXPECTED[kind]}, but got "
            f"{json_type(value)} instead."
        )
    if kind in BOUNDS and ctx:
        words, op, key = BOUNDS[kind]
        # pydantic does not say whether the field is an integer or a decimal one: the input does
        # only when it is a decimal
        number = "decimal" if isinstance(value, float) else "number"
        return (
            f"Invalid '{name}': {number} {words} value. Expected a value {op} "
            f"{_number(ctx.get(key))}, but got {_number(value)} instead."
        )
    if kind in ("too_short", "too_long") and isinstance(value, list | tuple | dict):
        limit = ctx.get("min_length" if kind == "too_short" else "max_length")
        if kind == "too_short" and not value:
            return (
                f"Invalid '{name}': empty array. Expected an array with minimum length {limit}, "
                "but got an empty array instead."
            )
        bound = "minimum" if kind == "too_short" else "maximum"
        return (
            f"Invalid '{name}': array too {kind.removeprefix('too_')}. Expected an array with "
            f"{bound} length {limit}, but got an array with length {len(value)} instead."
        )
    if kind in ("string_too_short", "string_too_long") and isinstance(value, str):
        short = kind == "string_too_short"
        limit = ctx.get("min_length" if short else "max_length")
        return (
            f"Invalid '{name}': string too {'short' if short else 'long'}. Expected a string "
            f"with {'minimum' if short else 'maximum'} length {limit}, but got a string with "
            f"length {len(value)} instead."
        )
    if kind in ("literal_error", "enum") and "expected" in ctx:
        return f"Invalid value: {quoted(value)}. Supported values are: {ctx['expected']}."
    if "expected_types" in ctx:  # a union's own error (a Discriminator's custom_error_context)
        return (
            f"Invalid type for '{name}': expected {ctx['expected_types']}, but got "
            f"{json_type(value)} instead."
        )
    if msg.startswith((f"{name} ", f"{name}[", f"{name}:")):
        return msg  # a check's message that names the field already
    return f"{name}: {msg}"


ANTHROPIC_WORDS = {"missing": "Field required", "extra_forbidden": "Extra inputs are not permitted"}
"""The reasons Anthropic's API gives after the field for a missing or an unknown field
("max_tokens: Field required")."""


def anthropic_message(error: Mapping[str, Any], param: str | None) -> str:
    """Anthropic's message for the pydantic `error` about body field `param` (None: the body):
    "<param>: Field required" for a missing field and "<param>: Extra inputs are not permitted"
    for an unknown one, as Anthropic's API words them; every other error in the words of
    `openai_message` (never pydantic's "Input should be ..." or "Value error, ").

    Examples:
        missing (param "max_tokens") -> "max_tokens: Field required"
        int_parsing, input "abc" (param "max_tokens") -> "Invalid type for 'max_tokens':
            expected an integer, but got a string instead."
        value_error, msg "Value error, block 0 has type 'image'" (param "messages[0].content")
            -> "messages[0].content: block 0 has type 'image'"
    """
    kind = str(error.get("type", ""))
    if kind in ANTHROPIC_WORDS and param is not None:
        return f"{param or 'body'}: {ANTHROPIC_WORDS[kind]}"
    return openai_message(error, param)
