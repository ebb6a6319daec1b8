"""Responses API <-> the chat turn: request items to chat messages, the chat result to output
items (docs/token-path.md, "Responses API").

Request -> chat (`chat_request`):

- `input` as a string is one user message; `instructions` a system message before everything.
- A message item (`{"role", "content"}`, `"type": "message"` optional) with role user, system,
  developer or assistant; content a string or text parts (`input_text`, `output_text`,
  `refusal`), joined. Images, files and audio are a 400 (the model reads text only).
- Items that one assistant turn produced are one assistant message, in the order this gateway
  emits them: a `reasoning` item starts it (`reasoning_content`), a message item gives its
  `content`, each `function_call` item adds a tool call `{"id": call_id, "type": "function",
  "function": {"name", "arguments"}}` with the arguments string as sent. So output items sent
  back as input rebuild exactly the assistant message the session recorded, and the turn
  extends the recorded history.
- `function_call_output` is a tool message `{"role": "tool", "tool_call_id": call_id,
  "content": output}` (text parts of a list output joined).
- Tools: `{"type": "function", "name", "description"?, "parameters"?, "strict"?}` becomes chat's
  `{"type": "function", "function": {...}}`. Built-in tools (web_search, file_search,
  computer_use, code_interpreter, image_generation, mcp, shell, custom, ...) are a 400: the
  gateway runs no tools, it only samples the model.
- `tool_choice`: "auto" / "none" / "required" as they are; `{"type": "function", "name"}` as
  chat's `{"type": "function", "function": {"name"}}`; others (built-in, allowed_tools) a 400.
- `text.format` becomes `response_format` (`json_schema`'s flat fields nested as chat's).

Chat -> output items (`output_items`): a `reasoning` item (the `<think>` text as
`reasoning_text` content), a `message` item with one `output_text` part (when the reply has text
or no tool call), one `function_call` item per tool call (`call_id` = the chat tool call id).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from flywheel.core.errors import InvalidRequestError
from flywheel.core.validation_messages import one_of, quoted, shown
from flywheel.gateway.api.constraints import check_choice_tools
from flywheel.gateway.api.responses_schema import ResponsesRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def new_id(prefix: str) -> str:
    """A fresh item or response id: `prefix` + "_" + 32 hex digits (128 random bits)."""
    return f"{prefix}_{os.urandom(16).hex()}"


def new_ids(*prefixes: str) -> list[str]:
    """One fresh id per prefix, as `new_id` makes them, from one read of the system's random
    source (128 random bits each). Example: new_ids("resp", "msg") -> ["resp_<32 hex>",
    "msg_<32 hex>"], the two hex strings the two halves of 32 random bytes."""
    bits = os.urandom(16 * len(prefixes)).hex()
    return [f"{p}_{bits[32 * i : 32 * i + 32]}" for i, p in enumerate(prefixes)]


def _text(content: Any, where: str, *, refusal: bool) -> str:
    """The text of a string or of a list of text parts.

    Raises:
        InvalidRequestError: another part type (image, file, audio) or a part without text.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of parts", param=where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if (refusal and kind == "refusal") else "text"
        if kind not in TEXT_PARTS and key != "refusal":
            raise InvalidRequestError(
                f"{where}[{k}] has type {quoted(kind)}; this model reads text only "
                f"(parts of type {', '.join(map(repr, TEXT_PARTS))})",
                param=f"{where}[{k}].type",
            )
        value = part.get(key)
        if not isinstance(value, str):
            raise InvalidRequestError(
                f"{where}[{k}] of type {kind!r} needs {key!r} as a string",
                param=f"{where}[{k}].{key}",
            )
        out.append(value)
    return "".join(out)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` content, else `encrypted_content` (which
    this gateway fills with the same text), else its summary."""
    parts = item.get("content") or []
    if parts:
        return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
    if isinstance(item.get("encrypted_content"), str):
        return str(item["encrypted_content"])
    return "".join(str(p.get("text", "")) for p in item.get("summary") or [] if isinstance(p, dict))


def _reasoning_only(turn: dict[str, Any] | None) -> bool:
    """Whether an assistant message built from items holds only reasoning so far."""
    return turn is not None and turn["content"] is None and "tool_calls" not in turn


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for Responses `input` (see the module docstring).

    Example: [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c1",
    "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1",
    "output": "3"}] -> [{"role": "user", "content": "Hi"}, {"role": "assistant", "content":
    None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f",
    "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "3"}].

    Raises:
        InvalidRequestError: an item of another type (param `input[i].type`), a bad role
            (`input[i].role`), a non-text part, or a missing field.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    open_turn: dict[str, Any] | None = None
    """The assistant message the items since the last non-assistant item belong to."""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError(
                    f"{where}.role must be one of {one_of(ROLES)}, got {shown(role)}",
                    param=f"{where}.role",
                )
            text = _text(item.get("content"), f"{where}.content", refusal=role == "assistant")
            if role != "assistant":
                out.append({"role": "system" if role == "developer" else role, "content": text})
                open_turn = None
            elif (
                open_turn is not None
                and open_turn["content"] is None
                and "tool_calls" not in open_turn
            ):
                open_turn["content"] = text  # after this turn's reasoning item
            else:
                open_turn = {"role": "assistant", "content": text}
                out.append(open_turn)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            if open_turn is None:
                open_turn = {"role": "assistant", "content": None}
                out.append(open_turn)
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output", refusal=False)
            out.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
            )
            open_turn = None
        elif kind == "reasoning":
            open_turn = {
                "role": "assistant",
                "content": None,
                "reasoning_content": _reasoning_text(item),
            }
            out.append(open_turn)
        else:
            raise InvalidRequestError(
                f"{where}: item type {quoted(kind)} is not supported; this gateway serves "
                f"{', '.join(ITEM_TYPES)} items (item_reference: send the item itself)",
                param=f"{where}.type",
            )
    for m in out:  # a turn of reasoning alone: empty text, as the parser records it
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat tools for Responses function tools.

    Raises:
        InvalidRequestError: a built-in tool type or a function tool without a string name.
    """
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(
                f"tools[{i}]: tool type {quoted(kind)} is not supported; this gateway samples the "
                "model and runs no built-in tools; declare a function tool "
                '({"type": "function"} with a "name" and "parameters") and run it yourself',
                param=f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str):
            raise InvalidRequestError(f"tools[{i}].name must be a string", param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Chat's `tool_choice` for the Responses one.

    Raises:
        InvalidRequestError: a built-in tool choice, `allowed_tools`, or a malformed value.
    """
    if choice is None or isinstance(choice, str):
        return choice  # "auto" | "none" | "required" (chat checks the value)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        f"tool_choice {shown(choice)} is not supported; use 'auto', 'none', 'required' or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def check_tool_choice(choice: str | dict[str, Any] | None, tools: list[Any] | None) -> None:
    """A forced call (`"required"`, `{"type": "function", "name"}`) needs tools, and a named
    function must be one of them; refused in the Responses shapes the request used (chat's
    own check would show the translated chat `tool_choice`).

    Raises:
        InvalidRequestError (param `tool_choice`): no tools, or a name not among them.
    """
    if choice is None or choice in ("auto", "none"):
        return
    names = [t.get("name") for t in tools or [] if isinstance(t, dict)]
    check_choice_tools(choice, names, choice.get("name") if isinstance(choice, dict) else None)


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` for Responses `text.format` (None when unset)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return dict(fmt)


def chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat request body (to be validated as a ChatCompletionRequest) for a Responses
    request, and the conversation it continues with (`history`, the stored conversation of
    `previous_response_id`, + this input; without the instructions) to store with its reply.

    Raises:
        InvalidRequestError: see `input_messages`, `chat_tools` and `chat_tool_choice`.
    """
    conversation = [*history, *input_messages(body.input)]
    tools = chat_tools(body.tools)
    choice = chat_tool_choice(body.tool_choice)
    check_tool_choice(body.tool_choice, body.tools)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    logprobs = body.includes("message.output_text.logprobs") or bool(body.top_logprobs)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": [*system, *conversation],
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "stream": body.stream,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "response_format": response_format(body.text),
    }
    return {k: v for k, v in chat.items() if v is not None}, conversation


CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
"""Chat parameter names whose Responses names differ (for error messages)."""


def output_items(
    message: dict[str, Any],
    finish_reason: str,
    message_id: str,
    *,
    logprobs: list[dict[str, Any]] | None = None,
    with_encrypted: bool = False,
    force_message: bool = False,
) -> list[dict[str, Any]]:
    """Output items of a chat reply `message` (`{"role": "assistant", "content",
    "tool_calls"?, "reasoning_content"?}`).

    `finish_reason` "length" marks the message item `incomplete`. `force_message`: emit the
    message item even for a tool-call-only reply (its text was already streamed).

    Example: {"content": None, "tool_calls": [{"id": "call_1", "function": {"name": "f",
    "arguments": "{}"}}]} -> [{"type": "function_call", "id": "fc_...", "call_id": "call_1",
    "name": "f", "arguments": "{}", "status": "completed"}].
    """
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        item: dict[str, Any] = {
            "id": new_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}],
        }
        if with_encrypted:
            item["encrypted_content"] = reasoning
        items.append(item)
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if force_message or content or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": content or "", "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        items.append(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "status": "incomplete" if finish_reason == "length" else "completed",
                "content": [part],
            }
        )
    for call in calls:
        fn = call["function"]
        items.append(
            {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


def _item_id(prefix: str, response_id: str, index: int) -> str:
    """A stable id for input item `index` of a stored response (the same on every listing, so
    `after` pages through them): `prefix` + "_" + 40 hex digits of SHA-256."""
    return f"{prefix}_{hashlib.sha256(f'{response_id}:{index}'.encode()).hexdigest()[:40]}"


def conversation_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses items of a stored conversation's chat `messages` (what `input_messages`
    made of the chain's inputs, with the replies as recorded), oldest first, for
    `GET /v1/responses/{id}/input_items`: user/system/assistant text as `message` items,
    tool calls as `function_call`, tool results as `function_call_output`, reasoning as
    `reasoning` items.

    Example: [{"role": "user", "content": "Hi"}] -> [{"id": "msg_<40 hex>", "type": "message",
    "role": "user", "status": "completed", "content": [{"type": "input_text", "text": "Hi"}]}].
    """
    items: list[dict[str, Any]] = []

    def add(prefix: str, item: dict[str, Any]) -> None:
        items.append({"id": _item_id(prefix, response_id, len(items)), **item})

    for m in messages:
        role, content = m.get("role"), m.get("content")
        text = (
            content
            if isinstance(content, str)
            else "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
        )
        if role == "tool":
            add(
                "fco",
                {
                    "type": "function_call_output",
                    "call_id": m.get("tool_call_id", ""),
                    "output": text,
                    "status": "completed",
                },
            )
            continue
        if role == "assistant" and m.get("reasoning_content") is not None:
            reasoning = [{"type": "reasoning_text", "text": m["reasoning_content"]}]
            add("rs", {"type": "reasoning", "summary": [], "content": reasoning})
        calls = (m.get("tool_calls") or []) if role == "assistant" else []
        if text or not calls:
            part: dict[str, Any] = {"type": "input_text", "text": text}
            if role == "assistant":
                part = {"type": "output_text", "text": text, "annotations": []}
            add(
                "msg",
                {"type": "message", "role": role, "status": "completed", "content": [part]},
            )
        for call in calls:
            fn = call.get("function") or {}
            add(
                "fc",
                {
                    "type": "function_call",
                    "call_id": call.get("id", ""),
                    "name": fn.get("name", ""),
                    "arguments": fn.get("arguments", ""),
                    "status": "completed",
                },
            )
    return items
