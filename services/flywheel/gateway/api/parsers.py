"""Parse tool calls and reasoning out of sampled text for the client (docs/token-path.md).

The recorded tokens stay the raw sampled ones; only the OpenAI message the client sees is
structured. Parsers are chosen per model family by name (`TOOL_PARSERS`).

- `hermes`: Hermes/Qwen style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `json`: the whole reply is one JSON object `{"name": ..., "arguments"|"parameters": {...}}`
  (or a list of them); used as the fallback when no hermes block is present.
- Cut off by the token limit (`truncated`, finish `length`): an unterminated last `<tool_call>`
  block is dropped from the text (never shown as content); the complete calls before it are
  returned. The recorded ids keep the sampled markup (docs/token-path.md).
- Reasoning: a leading `<think>...</think>` block becomes `reasoning_content` (an unclosed one,
  cut by the token limit, is all reasoning and leaves the content empty).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_content: str | None = None

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (what the client gets and sends back)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


def _tool_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(text outside the blocks, tool calls) for `<tool_call>` blocks with valid JSON."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = _tool_call(json.loads(block))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # a malformed block: leave the text untouched for the client
        calls.append(call)
    if not calls:
        return text, []
    return _HERMES.sub("", text).strip(), calls


def parse_json(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Tool calls when the whole reply is a JSON tool-call object or a list of them."""
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return text, []
    items = obj if isinstance(obj, list) else [obj]
    calls = [_tool_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return "", calls  # type: ignore[return-value]  # None excluded above


TOOL_PARSERS: dict[str, Callable[[str], tuple[str, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes,
    "json": parse_json,
}


def drop_unterminated_call(text: str) -> str:
    """`text` without a last `<tool_call>` block that has no closing `</tool_call>` (a call cut
    off by the token limit), trailing whitespace before it removed; unchanged otherwise."""
    start = text.rfind(TOOL_CALL_OPEN)
    if start < 0 or TOOL_CALL_CLOSE in text[start:]:
        return text
    return text[:start].rstrip()


def parse_reply(
    text: str, *, tools_offered: bool, tool_parser: str = "hermes", truncated: bool = False
) -> ParsedReply:
    """Split sampled text into reasoning, content and tool calls.

    Tool calls are parsed only when the request offered tools; the configured parser runs
    first and `json` is the fallback. `truncated`: the reply was cut off by the token limit
    (finish `length`); with tools offered, an unterminated last `<tool_call>` block is then
    dropped (`drop_unterminated_call`), so the client never gets tool-call markup as text.
    """
    reasoning = None
    match = _THINK.match(text)
    if match:
        reasoning = match.group(1).strip()
        text = text[match.end() :]
    elif text.lstrip().startswith("<think>"):
        # Reasoning cut off by the token limit (BUG-11 a): all of it is reasoning, no content.
        reasoning, text = text.lstrip()[len("<think>") :].strip(), ""
    calls: list[dict[str, Any]] = []
    if tools_offered and truncated:
        text = drop_unterminated_call(text)
    if tools_offered:
        for name in dict.fromkeys([tool_parser, "json"]):
            text_out, calls = TOOL_PARSERS[name](text)
            if calls:
                text = text_out
                break
    content = text if (text or not calls) else None
    return ParsedReply(content=content, tool_calls=calls, reasoning_content=reasoning)
