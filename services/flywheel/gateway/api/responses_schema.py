"""The `POST /v1/responses` request body (OpenAI Responses API) and its field policy.

Field policy (as for chat, `schemas.ChatCompletionRequest`): every Responses parameter is
declared. Those that do not change the sampled tokens (`metadata`, `user`, `safety_identifier`,
`service_tier`, `prompt_cache_retention`, `prompt_cache_options`, `reasoning`, `truncation`,
`stream_options`, `parallel_tool_calls`) are accepted without effect; those that need a service
the gateway does not run (`background`, `conversation`, `prompt`, `max_tool_calls`,
`context_management`) are a 400 unless they hold their neutral value; any other field is a 400
naming it. The items of `input` and the entries of `tools` are checked where they are turned into
the chat turn (responses_translate.py), which names the offending item (`input[3].type`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from flywheel.core.validation_messages import one_of
from flywheel.gateway.api import json_shapes as shapes

RESPONSE_ID_PATTERN = re.compile(r"resp_[A-Za-z0-9]{1,64}")
"""Ids of responses this gateway creates (`resp_` + 32 hex digits)."""

INCLUDABLE = frozenset(
    {
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
"""The `include` values OpenAI's API accepts. `message.output_text.logprobs` adds the sampled
tokens' logprobs to each `output_text` part; `reasoning.encrypted_content` adds the reasoning
text (not encrypted: the gateway keeps no secret) as `encrypted_content` of reasoning items; the
others concern items this gateway never produces (built-in tools, images) and have no effect."""

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "context_management": (None, []),
}
_WHY = {
    "background": "responses are served while the request waits (no background mode)",
    "conversation": "the Conversations API is not served; send the items as `input` or use "
    "previous_response_id",
    "prompt": "stored prompt templates are not served; send the text as `instructions`",
    "max_tool_calls": "it limits built-in tool calls, which are not served",
    "context_management": "server-side compaction is not served",
}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` body (see the module docstring for the field policy)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "required": ["model", "input"],
            "dependentSchemas": {
                **shapes.STREAM_OPTIONS_NEED_STREAM,
                **shapes.FORCED_CALL_NEEDS_TOOLS,
            },
        },
    )

    model: str
    """Required, as in OpenAI's API (a body without it is a 400 naming `model`)."""
    input: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[dict[str, Any]], Tag("list")],
        Discriminator(
            shapes.str_or_list,
            custom_error_type="input_type",
            custom_error_message="input must be a string or an array of input items",
            custom_error_context={"expected_types": "a string or an array of input items"},
        ),
        shapes.RESPONSES_INPUT,
    ]
    """A user message's text, or items: messages, function_call, function_call_output,
    reasoning (responses_translate.py)."""
    instructions: str | None = None
    """A system message put before the conversation (not carried to a later response that
    names this one as previous_response_id, as in OpenAI's API)."""
    tools: Annotated[list[dict[str, Any]] | None, shapes.RESPONSES_TOOLS] = Field(
        None, max_length=128
    )
    tool_choice: Annotated[str | dict[str, Any] | None, shapes.RESPONSES_TOOL_CHOICE] = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: shapes.Number | None = Field(None, ge=0, le=2)
    top_p: shapes.Number | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    store: StrictBool | None = None
    """Keep the response for `previous_response_id` (default true, as in OpenAI's API)."""
    previous_response_id: str | None = Field(None, pattern=f"^{RESPONSE_ID_PATTERN.pattern}$")
    include: Annotated[
        list[str] | None,
        WithJsonSchema(shapes.nullable({"type": "array", "items": {"enum": sorted(INCLUDABLE)}})),
    ] = None
    text: Annotated[dict[str, Any] | None, shapes.RESPONSES_TEXT] = None
    """`{"format": {"type": "text" | "json_schema" | "json_object", ...}, "verbosity"?}`; the
    format becomes the chat turn's `response_format`."""
    # Accepted without effect on the sampled tokens.
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    """Also names the request's live session (docs/sessions.md) when no header does."""
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    # Services the gateway does not run: neutral values only (see _NEUTRAL).
    background: Annotated[StrictBool | None, shapes.neutral(False)] = None
    conversation: Annotated[Any, shapes.ONLY_NULL] = None
    prompt: Annotated[Any, shapes.ONLY_NULL] = None
    max_tool_calls: Annotated[shapes.Int | None, shapes.ONLY_NULL] = None
    context_management: Annotated[Any, shapes.neutral([])] = None
    # SGLang extensions accepted as top-level keys (the SDK's extra_body), as for chat.
    top_k: Annotated[int | None, shapes.TOP_K] = Field(None, ge=-1, le=shapes.TOP_K_MAX)
    min_p: shapes.Number | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)

    @field_validator("max_output_tokens", "top_logprobs", "top_k", "seed", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return shapes.integer(v)  # no "10" or true as an integer

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream(cls, v: Any) -> Any:
        return False if v is None else v

    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, str) and not v:
            raise ValueError("input must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @field_validator("previous_response_id")
    @classmethod
    def _previous(cls, v: str | None) -> str | None:
        if v is not None and not RESPONSE_ID_PATTERN.fullmatch(v):
            raise ValueError(f"previous_response_id {v!r} is not a response id (resp_...)")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for i, value in enumerate(v or []):
            if value not in INCLUDABLE:
                raise ValueError(
                    f"include[{i}] {value!r} is not one of {one_of(sorted(INCLUDABLE))}"
                )
        return v

    @field_validator(*_NEUTRAL, mode="after")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None  # set for a field validator
        if v not in _NEUTRAL[info.field_name]:
            raise ValueError(
                f"{info.field_name} is not supported: {_WHY[info.field_name]}; leave it unset"
            )
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or a positive integer")
        return v

    @property
    def stores(self) -> bool:
        """Whether the response is kept for `previous_response_id` (`store`, default true)."""
        return self.store is not False

    def includes(self, value: str) -> bool:
        return value in (self.include or ())
