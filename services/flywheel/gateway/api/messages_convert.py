"""Anthropic Messages <-> the gateway's chat turn: one Messages request is one chat request
(`ChatCompletionRequest`, served by chat.serve), and its `chat.completion` is one `message`.

Request, block by block (worked examples in tests/unit/gateway/test_messages_convert.py):

- `system` (a string or text blocks) -> the first message, role "system".
- user `text` blocks -> one user message (consecutive blocks' texts concatenated as they are,
  as the chat path joins content parts); `tool_result` -> a message of role "tool" with
  `tool_call_id` = `tool_use_id` and its text (`is_error`: prefixed with `ERROR_PREFIX`, the only
  way a chat template can show it), in block order.
- assistant `thinking` -> `reasoning_content`, `text` -> `content`, `tool_use` ->
  `tool_calls[i] = {"id": id, "type": "function", "function": {"name", "arguments":
  json.dumps(input)}}`: the same string the parser (parsers.py) recorded for the model's JSON
  arguments, and sessions compare arguments as parsed JSON anyway (recording/history.py), so an
  assistant turn sent back as it was answered extends the recorded segment.
- `tools` -> function tools (`input_schema` as `parameters`); `tool_choice` auto/none/any/tool
  -> "auto"/"none"/"required"/a named function; `output_config.format` (json_schema) ->
  `response_format` json_schema; `stop_sequences` -> `stop`; `max_tokens`,
  `temperature`, `top_p`, `top_k` as they are.

Answer: `reasoning_content` -> a `thinking` block (`signature`: `signature(text)`, a digest of
its text, since nothing here is encrypted), `content` -> a `text` block (none when empty),
each tool call -> a `tool_use` block (`id` = the recorded call id in Anthropic's form,
`toolu_<hex>` for the gateway's `call_<hex>`, and back again in requests; `input` = its arguments
as an object; arguments that are not a JSON object come back as `{"arguments": <value>}`, which a
session then sees as an edited turn). `stop_reason`: length -> max_tokens, tool_calls ->
tool_use, stop -> stop_sequence when a stop sequence ended it (`stop_sequence` set), else
end_turn.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import ValidationError

from flywheel.core.errors import InvalidRequestError
from flywheel.core.http_errors import param_of
from flywheel.core.validation_messages import anthropic_message, shown
from flywheel.gateway.api.constraints import check_schemas
from flywheel.gateway.api.messages_schema import (
    ConversationRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from flywheel.gateway.api.request_rules import stale_tool_result
from flywheel.gateway.api.schemas import ChatCompletionRequest

_GATEWAY_CALL_ID = re.compile(r"call_([0-9a-f]{24})")
_ANTHROPIC_CALL_ID = re.compile(r"toolu_([0-9a-f]{24})")


def anthropic_tool_id(call_id: str) -> str:
    """The `tool_use` id for a recorded call id: `call_<24 hex>` (the gateway's, parsers.py) ->
    `toolu_<24 hex>`, as Anthropic's ids read; any other id as it is."""
    found = _GATEWAY_CALL_ID.fullmatch(call_id)
    return f"toolu_{found.group(1)}" if found else call_id


def chat_call_id(tool_use_id: str) -> str:
    """The recorded call id for a `tool_use` id the gateway answered (`anthropic_tool_id`
    undone), so a turn sent back as answered matches its record; any other id as it is."""
    found = _ANTHROPIC_CALL_ID.fullmatch(tool_use_id)
    return f"call_{found.group(1)}" if found else tool_use_id


ERROR_PREFIX = "Error: "
"""Put before a `tool_result` with `is_error: true` (chat messages have no error flag)."""


def _texts(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None:
        return ""
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _user(i: int, content: str | list[Any]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    text: list[str] | None = None
    for block in content:
        if isinstance(block, TextBlock):
            if text is None:
                text = []
                out.append({"role": "user", "content": ""})
            text.append(block.text)
            out[-1]["content"] = "".join(text)
        elif isinstance(block, ToolResultBlock):
            text = None
            result = _texts(block.content)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": chat_call_id(block.tool_use_id),
                    "content": ERROR_PREFIX + result if block.is_error else result,
                }
            )
        else:
            raise InvalidRequestError(
                f"messages[{i}]: a user message cannot hold a {block.type} block "
                "(only assistant messages do)",
                param=f"messages[{i}].content",
            )
    return out or [{"role": "user", "content": ""}]


def _assistant(i: int, content: str | list[Any]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, thinking, calls = [], [], []
    for block in content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(
                {
                    "id": chat_call_id(block.id),
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input)},
                }
            )
        else:
            raise InvalidRequestError(
                f"messages[{i}]: an assistant message cannot hold a {block.type} block "
                "(tool results go in the next user message)",
                param=f"messages[{i}].content",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def chat_messages(
    system: str | list[TextBlock] | None, messages: list[MessageParam]
) -> list[dict[str, Any]]:
    """The chat messages of an Anthropic conversation (see the module docstring).

    Raises:
        InvalidRequestError: a block in a message of the wrong role; the last message is the
            assistant's (prefilling a reply is not served: the gateway records whole turns).
    """
    out: list[dict[str, Any]] = []
    if system is not None and (text := _texts(system)):
        out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        out += _user(i, m.content) if m.role == "user" else [_assistant(i, m.content)]
    if messages[-1].role == "assistant":
        raise InvalidRequestError(
            "the last message is the assistant's: prefilling the reply is not supported; end "
            "the conversation with a user message",
            param=f"messages[{len(messages) - 1}]",
        )
    return out


def chat_tools(body: ConversationRequest) -> list[dict[str, Any]] | None:
    """Function tools of the chat path for Anthropic `tools` (None without tools)."""
    if not body.tools:
        return None
    out = []
    for tool in body.tools:
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        fn["parameters"] = tool.input_schema
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """auto -> "auto", none -> "none", any -> "required", tool -> the named function."""
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "none": "none", "any": "required"}[choice.type]


def check_tool_choice(body: MessagesRequest) -> None:
    """`tool_choice` any/tool needs tools, and a named tool must be one of them; refused in
    Anthropic's shapes (chat's own check would show the translated chat `tool_choice`).

    Raises:
        InvalidRequestError (param `tool_choice`): no tools, or a name not among them.
    """
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return
    given = {"type": "tool", "name": choice.name} if choice.type == "tool" else {"type": "any"}
    names = [tool.name for tool in body.tools or []]
    if not names:
        raise InvalidRequestError(
            f"tool_choice: {shown(given)} needs tools: give the tools the model must call",
            param="tool_choice",
        )
    if choice.type == "tool" and choice.name not in names:
        raise InvalidRequestError(
            f"tool_choice: tool {choice.name!r} is not in tools ({', '.join(map(repr, names))})",
            param="tool_choice",
        )


def chat_request(body: ConversationRequest, *, sampling: bool = True) -> ChatCompletionRequest:
    """The one chat request a Messages (`sampling`) or count_tokens request is served as.

    Raises:
        InvalidRequestError: see `chat_messages`; or the chat path refuses a translated field
            (e.g. `tool_choice` any/tool naming no offered tool), named
            by its Anthropic field.
    """
    data: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.system, body.messages),
        "tools": chat_tools(body),
    }
    if sampling:
        assert isinstance(body, MessagesRequest)  # count_tokens samples nothing
        check_tool_choice(body)
        data.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            tool_choice=chat_tool_choice(body.tool_choice),
        )
        if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
            data["parallel_tool_calls"] = False
        fmt = (body.output_config or {}).get("format")
        if fmt is not None:
            data["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt["schema"]},
            }
    try:
        turn = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_of(("body", *first["loc"]))
        raise InvalidRequestError(anthropic_message(first, param), param=param) from None
    if sampling:
        assert isinstance(body, MessagesRequest)
        if body.stop_sequences:  # Anthropic's own bound (32), not chat's 4 stop strings
            turn = turn.model_copy(update={"stop": list(body.stop_sequences)})
        check_schemas(turn, "output_config.format.schema", "tools[{i}].input_schema")
    return turn


def signature(thinking: str) -> str:
    """The `signature` of a thinking block: "sha256:" + the hex SHA-256 of its UTF-8 text.
    Example: signature("") = "sha256:e3b0c442...b855". Not required back, not checked: the
    session compares the history with what it recorded."""
    return "sha256:" + hashlib.sha256(thinking.encode()).hexdigest()


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's `input` object for its recorded `arguments` JSON text.
    Example: '{"city": "Paris"}' -> {"city": "Paris"}; '"Paris"' -> {"arguments": "Paris"}."""
    try:
        value = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The `content` blocks of a chat assistant message (see the module docstring)."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:
        text = message["reasoning_content"]
        blocks.append({"type": "thinking", "thinking": text, "signature": signature(text)})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": anthropic_tool_id(call["id"]),
                "name": fn["name"],
                "input": tool_input(fn["arguments"]),
            }
        )
    return blocks


def stop_reason(finish: str, matched_stop: str | None) -> str:
    """Anthropic's `stop_reason` for a chat `finish_reason` (and the stop string that ended
    the turn, if any)."""
    if finish == "length":
        return "max_tokens"
    if finish == "tool_calls":
        return "tool_use"
    return "stop_sequence" if matched_stop is not None else "end_turn"


def message(completion: dict[str, Any], matched_stop: str | None) -> dict[str, Any]:
    """The Anthropic `message` for a one-choice `chat.completion` body; `matched_stop`: the stop
    sequence that ended the turn (None: another end)."""
    (choice,) = completion["choices"]
    reason = stop_reason(choice["finish_reason"], matched_stop)
    usage = completion["usage"]
    return {
        "id": "msg_" + completion["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content_blocks(choice["message"]),
        "stop_reason": reason,
        "stop_sequence": matched_stop if reason == "stop_sequence" else None,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
        },
    }


def check_tool_results(turn: ChatCompletionRequest) -> None:
    """Refuse a `tool_result` whose `tool_use_id` answers no `tool_use` earlier in the messages
    (`request_rules.stale_tool_result`; Anthropic's API answers such a request with a 400).

    Raises:
        InvalidRequestError: naming the `tool_use_id`, param `messages`.
    """
    if not any(m.role == "tool" for m in turn.messages):  # no tool_result: nothing to refuse
        return
    stale = stale_tool_result([m.for_template() for m in turn.messages])
    if stale is not None:
        raise InvalidRequestError(
            "messages: unexpected `tool_use_id` found in `tool_result` blocks: "
            f"{anthropic_tool_id(stale[1])}. "
            "Each `tool_result` block must have a corresponding `tool_use` block earlier in "
            "the messages.",
            param="messages",
        )
