"""Request models of the Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`).

Shapes follow Anthropic's API reference (the `anthropic` SDK's `MessageCreateParams`). Field
policy, as for chat completions (schemas.py): every field that changes the sampled tokens is
honored or refused; fields without effect on them (`metadata`, `service_tier`, `thinking`,
`cache_control`, `citations`, `output_config.effort`, `speed`, `diagnostics`, ...) are accepted
and have no effect; any other field is a 400 naming
it. Validation errors are answered in Anthropic's error JSON (messages_errors.py).

Refused with a 400 that says why: `image`, `document` and other non-text blocks (the model reads
text only), `redacted_thinking` blocks (encrypted reasoning of another provider: this gateway
never produces them and cannot render them; drop them from the history), server tools (a `type`
other than `custom`: the gateway runs no tools), and `mcp_servers` / `container`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from flywheel.core.validation_messages import shown
from flywheel.gateway.api import json_shapes as shapes


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_control: dict[str, Any] | None = None
    """Accepted without effect (the engine's prefix cache needs no marks)."""


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    """The tool's output: a string or text blocks (the model reads text only)."""
    is_error: StrictBool = False
    toolset_name: str | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    """What the gateway put there (messages_convert.signature): not checked on the way back."""


class UnreadableBlock(BaseModel):
    """A block the model cannot read: refused by `ContentBlock`'s validator with a message."""

    model_config = ConfigDict(extra="allow")

    type: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]

READABLE = ("text", "tool_use", "tool_result", "thinking")


def _refuse_unreadable(blocks: Any) -> Any:
    """Raise a clear error for a block type the gateway does not serve (before the union's own,
    less readable, discriminator error)."""
    if not isinstance(blocks, list):
        return blocks
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise ValueError(
                f"block {i} must be an object with a 'type' among "
                f"{', '.join(map(repr, READABLE))}; got {shown(block)}"
            )
        if kind == "redacted_thinking":
            raise ValueError(
                f"block {i} is redacted_thinking: encrypted reasoning of another provider, which "
                "this gateway never produces and cannot render; drop it from the history"
            )
        if isinstance(kind, str) and kind not in READABLE:
            raise ValueError(
                f"block {i} has type {kind!r}; this model reads text only (blocks of type "
                f"{', '.join(map(repr, READABLE))})"
            )
    return blocks


def _content_kind(v: Any) -> str | None:
    return "str" if isinstance(v, str) else "list[blocks]" if isinstance(v, list) else None


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[ContentBlock], Tag("list[blocks]")],
        Discriminator(
            _content_kind,
            custom_error_type="content_type",
            custom_error_message=(
                f"content must be a string or a list of blocks of type {', '.join(READABLE)}"
            ),
        ),
    ]
    """A string, or a list of blocks; the errors of a rejected one are those of the branch its
    JSON type picks (never the other branch's "Input should be a valid string")."""

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        return _refuse_unreadable(v)


class ToolParam(BaseModel):
    """A client tool (`type` "custom" or absent) with its JSON-schema `input_schema`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: StrictBool | None = None
    """Accepted; `tool_choice` any/tool is what forces a call (constrained decoding)."""
    eager_input_streaming: StrictBool | None = None
    defer_loading: StrictBool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, v: Any) -> Any:
        """A server tool (`{"type": "web_search_20250305", "name": "web_search"}`) is refused
        for what it is, before its fields are checked as a custom tool's (it has no
        `input_schema`)."""
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in (None, "custom"):
            raise PydanticCustomError(
                "server_tool",
                "server tools are not supported: tool type {kind} is a server tool and this "
                "gateway runs no tools; declare it as a custom tool (name, description, "
                "input_schema) and run it in the client",
                {"kind": repr(kind)},
            )
        return v


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None
    """Accepted without effect: the model's reply holds the calls it wrote."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None, info: Any) -> str | None:
        if info.data.get("type") == "tool" and not v:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return v


class Metadata(BaseModel):
    """Anthropic's `metadata`: an opaque `user_id` (a string or null), accepted without
    effect."""

    model_config = ConfigDict(extra="forbid")

    user_id: str | None = Field(None, max_length=256)


class ThinkingEnabled(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted"] | None = None

    @field_validator("budget_tokens", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return shapes.integer(v)  # no "2048" or true as an integer


class ThinkingAdaptive(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingPlain(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["disabled", "between_tools"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingPlain, Field(discriminator="type")
]
"""Anthropic's `thinking` (the SDK's `ThinkingConfigParam`): `{"type": "enabled",
"budget_tokens" >= 1024}`, `adaptive`, `disabled` or `between_tools`; any other shape is a
400."""


class ConversationRequest(BaseModel):
    """Fields `messages` and `count_tokens` share."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1)
    messages: Annotated[list[MessageParam], shapes.ANTHROPIC_MESSAGES] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    """Checked, then accepted without effect: reasoning the model writes (`<think>`) always
    comes back as `thinking` blocks; the served model decides whether it reasons."""

    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    """`effort` is accepted without effect; `format` `{"type": "json_schema", "schema"}` makes
    the reply JSON valid for the schema (chat's `response_format`, constrained decoding)."""
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None

    @field_validator("output_config")
    @classmethod
    def _output_config(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        fmt = (v or {}).get("format")
        if fmt is not None and (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise ValueError(
                "output_config.format must be {'type': 'json_schema', 'schema': {...JSON "
                "schema...}}"
            )
        return v

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, v: Any) -> Any:
        return _refuse_unreadable(v)


class CountTokensRequest(ConversationRequest):
    """`POST /v1/messages/count_tokens` body."""


class MessagesRequest(ConversationRequest):
    """`POST /v1/messages` body."""

    max_tokens: int = Field(ge=1)
    temperature: shapes.Number | None = Field(None, ge=0, le=1)
    top_p: shapes.Number | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1, le=shapes.TOP_K_MAX)
    """Sampling fields of Anthropic's API before the SDK dropped them (send them with
    `extra_body`); unset: temperature 1, the whole vocabulary."""
    stop_sequences: list[str] | None = Field(None, max_length=32)
    stream: StrictBool = False
    metadata: Metadata | None = None
    """Accepted without effect."""
    service_tier: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @field_validator("max_tokens", "top_k", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return shapes.integer(v)  # no "10" or true as an integer
