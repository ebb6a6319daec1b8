"""Constrained decoding for a chat turn: forced tool calls and structured output as SGLang params.

Every wire API (chat, Responses, Anthropic Messages) translates its request into one chat turn;
this module turns that turn's `tool_choice`, `response_format` and SGLang's `regex` / `ebnf` /
`json_schema` extras into at most one of SGLang's grammar sampling params, which the engine
(SGLang or the embedded one, both through xgrammar) applies per decode step:

- `tool_choice: "required"` -> `structural_tag`: one or more tool calls in the model's
  tool-call format and nothing else; `parallel_tool_calls: false` allows exactly one. A named
  function (`{"type": "function", "function": {"name"}}`) -> exactly one call of it. With the
  `hermes` parser a call is `<tool_call>\\n{"name": "<name>", "arguments": <JSON valid for the
  tool's parameters>}\\n</tool_call>` (what the chat template teaches and `parsers.parse_hermes`
  reads); with the `json` parser a bare `{"name", "arguments"}` object (a structural tag of
  one `json_schema` content).
  After a complete call the row may always end (EOS): parallel calls are separated by one
  newline, and one trailing newline is allowed, so a newline never forces a further call.
  Whitespace between the JSON tokens of the arguments comes in runs of at most
  `MAX_WHITESPACE` characters: unbounded, a small model that starts writing newlines inside
  the arguments may keep writing them until max_tokens, and the call never completes. With
  `parallel_tool_calls: false` or a named function, a complete call leaves only EOS allowed,
  so the row ends right after it (the engine samples the EOS from the masked distribution).
- `response_format` `json_schema` -> `json_schema` (its `schema`); `json_object` ->
  `json_schema` `{"type": "object"}`; `text` -> nothing.
- a schema that is not a valid JSON Schema (`{"type": "nonsense"}`) is a 400 naming where it
  is (`response_format.json_schema.schema`, `tools[i].function.parameters`), checked here with
  jsonschema's Draft 2020-12 meta-schema before anything reaches the engine.
- more than one constraint (a forced call plus a response_format or regex, ...) is a 400, as
  SGLang answers it.

What a constrained token means for training is in docs/token-path.md ("Constrained tokens").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from flywheel.core.errors import InvalidRequestError
from flywheel.core.validation_messages import quoted

ANY_OBJECT = {"type": "object"}
"""Arguments schema of a tool that declares no parameters, and json_object's schema."""

MAX_WHITESPACE = 10
"""Longest run of whitespace characters between the JSON tokens of a forced call's arguments:
a newline and two levels of 4-space indentation (9 characters) fit, so the pretty-printed JSON
models write is allowed; a run of newlines ends after 10 (xgrammar's `max_whitespace_cnt`)."""


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else dict(ANY_OBJECT)


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    """xgrammar structural-tag content: JSON valid for `schema`, whitespace runs bounded."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _hermes_tag(tool: dict[str, Any]) -> dict[str, Any]:
    """xgrammar structural-tag `tag` for one call of `tool` in the hermes format."""
    name = json.dumps(tool["function"]["name"])
    return {
        "type": "tag",
        "begin": f'<tool_call>\n{{"name": {name}, "arguments": ',
        "content": _json_content(_params_schema(tool)),
        "end": "}\n</tool_call>",
    }


def _json_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one bare `{"name", "arguments"}` call of any of `tools`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": _params_schema(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def check_schema(schema: Any, param: str) -> None:
    """Refuse `schema` unless it is a valid JSON Schema (Draft 2020-12 meta-schema).

    Raises:
        InvalidRequestError (param `param`): e.g. `{"type": "nonsense"}` -> "... is not a valid
            JSON Schema: 'nonsense' is not valid under any of the given schemas (at type)".
    """
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the top level"
        raise InvalidRequestError(
            f"{param} is not a valid JSON Schema: {e.message} (at {where})", param=param
        ) from None


def check_schemas(
    body: Any,
    schema_param: str = "response_format.json_schema.schema",
    tool_param: str = "tools[{i}].function.parameters",
) -> None:
    """Check the JSON Schemas a chat turn's grammar would be compiled from: the
    `response_format` json_schema and the parameters of every tool a call is forced among.

    Args:
        body: the chat turn (`schemas.ChatCompletionRequest`).
        schema_param, tool_param: the wire API's names of the two (`{i}`: the tool's index in
            `tools`), e.g. Responses' `text.format.schema` and `tools[{i}].parameters`.

    Raises:
        InvalidRequestError: param `schema_param` or `tool_param`; see `check_schema`.
    """
    fmt = body.response_format or {}
    spec = fmt.get("json_schema") if fmt.get("type") == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        check_schema(spec["schema"], schema_param)
    forced = forced_tools(body) or []
    for i, tool in enumerate(body.tools or []):
        params = tool["function"].get("parameters")
        if tool in forced and isinstance(params, dict):
            check_schema(params, tool_param.format(i=i))


def check_choice_tools(choice: Any, names: Sequence[str | None], name: str | None) -> None:
    """A forced call needs tools, and a named function must be one of them: `choice` is the
    `tool_choice` as the client wrote it (chat's or Responses' shape, shown in the message),
    `names` the offered functions' names, `name` the function it names (None: "required").

    Raises:
        InvalidRequestError (param `tool_choice`): no tools, or `name` not among `names`.
    """
    given = quoted(choice)
    if not names:
        raise InvalidRequestError(
            f"tool_choice {given} needs tools: give the functions the model must call",
            param="tool_choice",
        )
    if name is not None and name not in names:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not in tools "
            f"({', '.join(map(repr, names))})",
            param="tool_choice",
        )


def forced_tools(body: Any) -> list[dict[str, Any]] | None:
    """The tools a call is forced among (`tool_choice` required or named), else None.

    Raises:
        InvalidRequestError (param `tool_choice`): a forced call without tools, or a named
            function that is not in `tools` (`check_choice_tools`).
    """
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    tools = list(body.tools or [])
    name = None if choice == "required" else (choice.get("function") or {}).get("name")
    check_choice_tools(choice, [t["function"]["name"] for t in tools], name)
    if name is None:
        return tools
    return [t for t in tools if t["function"]["name"] == name][:1]


def tool_call_constraint(body: Any, tool_parser: str) -> dict[str, str]:
    """The grammar param that forces a well-formed tool call, or {} when none is forced:
    always `structural_tag` (xgrammar's format), whose JSON contents bound whitespace runs to
    `MAX_WHITESPACE` characters, e.g. `{"a":` + 11 newlines is refused at the 11th."""
    tools = forced_tools(body)
    if tools is None:
        return {}
    fmt: dict[str, Any]
    if tool_parser == "json":
        fmt = _json_content(_json_call_schema(tools))
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}
    tags = [_hermes_tag(t) for t in tools]
    single = body.tool_choice != "required" or body.parallel_tool_calls is False
    if single:
        fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    else:
        calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n"}
        calls["at_least_one"] = True
        # an optional newline after the last call: a model that writes one where the template
        # would put the next call may still stop (EOS) there instead of being forced into
        # another call until max_tokens; the parser drops whitespace around the calls
        fmt = {"type": "sequence", "elements": [calls, {"type": "regex", "pattern": "\\n?"}]}
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}


def response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, str]:
    """The `json_schema` param for `response_format` json_schema / json_object, {} for text.

    Raises:
        InvalidRequestError (param `response_format`): json_schema without a schema object.
    """
    fmt = response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return {"json_schema": json.dumps(ANY_OBJECT)}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", ANY_OBJECT) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                "{...JSON schema...}}}",
                param="response_format",
            )
        return {"json_schema": json.dumps(schema)}
    return {}


def grammar_params(body: Any, tool_parser: str) -> dict[str, str]:
    """SGLang grammar sampling params for a chat turn: at most one of json_schema, regex, ebnf,
    structural_tag (empty when nothing constrains the turn).

    Args:
        body: the chat turn (`schemas.ChatCompletionRequest`): `tools`, `tool_choice`,
            `parallel_tool_calls`, `response_format`, `regex`, `ebnf`, `json_schema`.
        tool_parser: the gateway's tool-call format ("hermes" or "json").

    Raises:
        InvalidRequestError: see `forced_tools`, `check_schemas` and
            `response_format_constraint`; or more than one constraint asked for (param names
            the second one).
    """
    check_schemas(body)
    asked: list[tuple[str, dict[str, str]]] = [
        ("tool_choice", tool_call_constraint(body, tool_parser)),
        ("response_format", response_format_constraint(body.response_format)),
    ]
    for key in ("regex", "ebnf", "json_schema"):
        value = getattr(body, key)
        if value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            asked.append((key, {key: text}))
    given = [(name, params) for name, params in asked if params]
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise InvalidRequestError(
            f"{names} each constrain the output and cannot be combined; send only one",
            param=given[1][0],
        )
    return given[0][1] if given else {}
