"""The only place in Flywheel that turns text into token ids (docs/token-path.md, house style C4).

`ChatRenderer` renders OpenAI messages with the served model's chat template and tokenizes the
result; `extend` renders only the new suffix of a conversation and tokenizes it on its own, so
recorded token ids (what the engine sampled) are never re-tokenized.

Templates without tool support (SmolLM2's ignores `tools` and `tool_calls`) would silently drop
the client's tools: for them the tool signatures go into the system message in the Hermes format
the `hermes` parser reads back (`<tools>` JSON lines, `<tool_call>{"name", "arguments"}` replies),
and past assistant tool calls are rendered as the `<tool_call>` text the model produced. The same
rendering is used for every request, so prefix checks compare like with like.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from flywheel.core.errors import InvalidRequestError
from flywheel.gateway.render.prefix_ids import PrefixIds

INLINE_RENDER_CHARS = 8192
"""Conversations up to this many characters are rendered and tokenized on the event loop (well
under a millisecond; a thread hop would cost about as much); longer ones in a worker thread so
one long prompt never stalls the other requests."""

PREFIX_CACHE_BYTES = 32 << 20
"""Memory a renderer keeps for prompt prefix ids by default."""

T = TypeVar("T")


def text_size(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """Characters of the messages' contents and tool calls plus the tool definitions (an upper
    bound's worth of what the template renders, without rendering it)."""
    size = len(json.dumps(tools)) if tools else 0
    for m in messages:
        content = m.get("content")
        size += len(content) if isinstance(content, str) else len(json.dumps(content or ""))
        if m.get("tool_calls"):
            size += len(json.dumps(m["tool_calls"]))
    return size


async def render_call(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` inline when `size` (characters, see `text_size`) is at most
    `INLINE_RENDER_CHARS`, else in a worker thread."""
    if size <= INLINE_RENDER_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True)
class Extension:
    """How a request extends a recorded conversation.

    `suffix_ids` are the template tokens after the recorded ids (the end of the last sampled
    turn, the new messages and the generation prompt); they are never sampled (loss mask 0).
    """

    suffix_ids: list[int]


class ChatRenderer:
    """Chat-template rendering and tokenization for one model.

    Args:
        tokenizer_path: a Hugging Face folder with tokenizer files and a chat template.
        prefix_cache_bytes: memory for the ids of recent prompt prefixes, kept to tokenize
            fresh prompts faster (prefix_ids.py); 0 = none.
    """

    def __init__(self, tokenizer_path: str | Path, prefix_cache_bytes: int = PREFIX_CACHE_BYTES):
        from transformers import AutoTokenizer  # noqa: PLC0415  (heavy import after settings)

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(f"tokenizer at {tokenizer_path} has no chat template")
        self._fast = getattr(self.tokenizer, "backend_tokenizer", None)
        """The Rust `tokenizers.Tokenizer` behind a fast tokenizer (None: a slow tokenizer)."""
        self.eos_token: str = self.tokenizer.eos_token or ""
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        probe_tool = [{"type": "function", "function": {"name": "probe", "parameters": {}}}]
        user: list[dict[str, Any]] = [{"role": "user", "content": "x"}]
        self.renders_tools = self._apply(user, probe_tool, True) != self._apply(user, None, True)
        """The template renders `tools` itself (else the gateway adds them to the system turn)."""
        call = {"id": "c", "type": "function", "function": {"name": "probe", "arguments": "{}"}}
        said = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}]
        plain = [*user, {"role": "assistant", "content": ""}]
        self.renders_tool_calls = self._apply(said, None, False) != self._apply(plain, None, False)
        """The template renders assistant `tool_calls` itself."""
        self.prefixes = PrefixIds(self.encode, self.eos_token, prefix_cache_bytes)
        """Ids of recent prompt prefixes, cut after the end-of-turn token (`prompt_ids`)."""

    def _apply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return cast(str, text)  # tokenize=False: the rendered text

    def _with_tools(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """Messages with tool signatures and tool calls in text, for templates lacking them."""
        out = []
        for m in messages:
            m = {**m, "content": m.get("content") or ""}
            if m["role"] == "assistant" and m.get("tool_calls") and not self.renders_tool_calls:
                m["content"] += "".join(_call_text(c) for c in m["tool_calls"])
            out.append(m)
        if tools and not self.renders_tools:
            block = _tools_text(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for `messages` (and `tools`).

        Raises:
            InvalidRequestError: the template rejects the conversation (e.g. bad role order).
        """
        # Templates concatenate content as text: a tool-call-only reply has content None.
        messages = self._with_tools(messages, tools)
        try:
            return self._apply(
                messages, tools if self.renders_tools else None, add_generation_prompt
            )
        except Exception as exc:  # jinja2 raises TemplateError and plain exceptions
            raise InvalidRequestError(
                f"the chat template cannot render these messages: {exc}", param="messages"
            ) from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as it stands (no BOS/EOS added): the Rust tokenizer directly
        when there is one (the same ids as `tokenizer(text)`, without its Python wrapping)."""
        if self._fast is not None:
            if len(text) > INLINE_RENDER_CHARS:  # a worker thread's: let the event loop run
                # (`encode_batch` releases the GIL while it tokenizes, `encode` holds it: 3.3 s
                # of a frozen gateway for a 3.9 MB prompt)
                return self._fast.encode_batch([text], add_special_tokens=False)[0].ids
            return self._fast.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Ids of a fresh prompt: the rendered conversation plus the generation prompt (the
        same ids as `encode` of the rendering; a prefix seen recently is not tokenized again)."""
        return self.prefixes.encode(self.render(messages, tools=tools))

    def extend(
        self,
        recorded: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        ended_with_eos: bool = True,
    ) -> Extension | None:
        """Template tokens that follow the recorded conversation, or None if it is not a prefix.

        `recorded` ends with the assistant turn the engine sampled (its ids, including the
        sampled EOS, are already recorded). The rendering of `messages` must start with the
        rendering of `recorded` up to that turn's end-of-turn token (included when the engine
        sampled it, `ended_with_eos`; otherwise the template's end-of-turn text becomes part of
        the suffix); the text after the cut is tokenized on its own.
        """
        if not recorded or recorded[-1].get("role") != "assistant":
            return None
        before = self.render(recorded, tools=tools, add_generation_prompt=False)
        cut = before.rfind(self.eos_token) if self.eos_token else -1
        if cut < 0:
            return None
        if ended_with_eos:
            cut += len(self.eos_token)
        full = self.render(messages, tools=tools)
        if not full.startswith(before[:cut]):
            return None
        return Extension(suffix_ids=self.encode(full[cut:]))

    def decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence


def _tools_text(tools: list[dict[str, Any]]) -> str:
    """Tool signatures and the call format, Hermes style (what `parsers.parse_hermes` reads)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. "
        "The function signatures are inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, reply with a JSON object of its name and arguments inside "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        args = fn.get("arguments")
    return f"<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n</tool_call>"
