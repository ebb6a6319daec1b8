"""The only place in Flywheel that turns text into token ids (DESIGN.md section 5, house style C4).

`ChatRenderer` renders OpenAI messages with the served model's chat template and tokenizes the
result; `extend` renders only the new suffix of a conversation and tokenizes it on its own, so
recorded token ids (what the engine sampled) are never re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.core.errors import InvalidRequestError


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
    """

    def __init__(self, tokenizer_path: str | Path):
        from transformers import AutoTokenizer  # noqa: PLC0415  (heavy import after settings)

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(f"tokenizer at {tokenizer_path} has no chat template")
        self.eos_token: str = self.tokenizer.eos_token or ""
        self.eos_token_id: int | None = self.tokenizer.eos_token_id

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
        messages = [{**m, "content": m.get("content") or ""} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # jinja2 raises TemplateError and plain exceptions
            raise InvalidRequestError(
                f"the chat template cannot render these messages: {exc}", param="messages"
            ) from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as it stands (no BOS/EOS added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Ids of a fresh prompt: the rendered conversation plus the generation prompt."""
        return self.encode(self.render(messages, tools=tools))

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
        return self.tokenizer.decode(ids, skip_special_tokens=True)
