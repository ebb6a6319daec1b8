"""HTTP request models of the gateway (OpenAI chat completions and Flywheel sessions).

Invalid values and unrecognized fields fail validation and are answered with OpenAI error JSON
(core/http_errors.py); see `ChatCompletionRequest` for the field policy.
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
    field_validator,
)

from flywheel.core.validation_messages import quoted, shown
from flywheel.gateway.api import json_shapes as shapes
from flywheel.gateway.api.constraints import grammar_params

SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""Session ids a client may choose (URL prefix, `X-Session-Id`, `POST /v1/sessions`)."""


Stop = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Tag("list"), Field(max_length=4)],
    Discriminator(
        shapes.str_or_list,
        custom_error_type="stop_type",
        custom_error_message="stop must be a string or an array of up to 4 strings",
    ),
]
"""OpenAI's `stop`: a string, or an array of up to 4 strings (a refused array's error is the
array's, never the string branch's "expected a string")."""


TEXT_PARTS = ("text", "input_text", "output_text")
"""Content-part types that hold text (`text`); the model reads nothing else."""


def check_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content parts the model can read: text parts with a string `text`, and assistant
    `refusal` parts with a string `refusal`.

    Raises:
        ValueError: another part type (image, audio, file: the model reads text only), or a
            part without its string.
    """
    for i, part in enumerate(parts):
        kind = part.get("type")
        key = "refusal" if kind == "refusal" else "text"
        if kind not in (*TEXT_PARTS, "refusal"):
            raise ValueError(
                f"content part {i} has type {quoted(kind)}; this model reads text only "
                f"(parts of type {', '.join(map(repr, TEXT_PARTS))})"
            )
        if not isinstance(part.get(key), str):
            raise ValueError(f"content part {i} of type {kind!r} needs {key!r} as a string")
    return parts


def check_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls`: each `{"id"?, "type": "function", "function": {"name": str,
    "arguments": JSON text (or an object)}}`.

    Raises:
        ValueError: a call of another shape.
    """
    for i, call in enumerate(calls):
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(
                f'tool call {i} must be {{"type": "function", "function": '
                '{"name": ..., "arguments": ...}}'
            )
        if not isinstance(fn.get("name"), str) or not isinstance(
            fn.get("arguments", ""), str | dict | None
        ):
            raise ValueError(
                f"tool call {i}: function.name must be a string and "
                "function.arguments a JSON string"
            )
    return calls


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        return check_parts(v) if isinstance(v, list) else v

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if v is None else check_tool_calls(v)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("role") == "tool":
            raise ValueError(
                "a message with role 'tool' needs the tool_call_id of the call it answers"
            )
        return v

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (content parts joined to text)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(
                p.get("refusal" if p.get("type") == "refusal" else "text", "") for p in self.content
            )
        if data["role"] == "developer":
            data["role"] = "system"
        data.setdefault("content", "")
        return data


_NEUTRAL: dict[str, Any] = {
    # OpenAI fields that change sampling; the engine cannot honor them, so only their neutral
    # values are accepted (a silently ignored penalty would record tokens drawn from another
    # distribution than the client asked for).
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "prediction": (None,),
    "audio": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None,),
    # SGLang extensions (the SDK's extra_body) the embedded engine does not implement.
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "chat_template_kwargs": (None, {}),
}


class StreamOptionsNeedStream(BaseModel):
    """Base of the chat and text completion requests: OpenAI's API refuses `stream_options`
    without `stream: true` (a 400 naming `stream_options`). The subclass declares both fields,
    `stream` first."""

    @field_validator("stream_options", check_fields=False)
    @classmethod
    def _stream_options(
        cls, v: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v


class ChatCompletionRequest(StreamOptionsNeedStream):
    """`POST /v1/chat/completions` body.

    Field policy (BUG-30): every OpenAI chat-completion parameter is declared. Those that do not
    change the sampled tokens (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`,
    `prompt_cache_*`, `safety_identifier`, `verbosity`, `reasoning_effort`, `moderation`,
    `modalities`) are accepted and have no effect; those that would change sampling and that
    the engine cannot honor (penalties, `logit_bias`, legacy `functions`, ...) are a 400 unless
    they hold their neutral value. Any other field is a 400 naming it, as OpenAI answers an
    unrecognized argument: nothing that could change sampling is ignored silently.
    """

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "dependentSchemas": {
                **shapes.STREAM_OPTIONS_NEED_STREAM,
                **shapes.FORCED_CALL_NEEDS_TOOLS,
                # Two caps must agree; documented: send one of them.
                "max_completion_tokens": {"properties": {"max_tokens": False}},
                "top_logprobs": {
                    "properties": {"logprobs": {"const": True}},
                    "required": ["logprobs"],
                },
            }
        },
    )

    model: str
    """Required, as in OpenAI's API (a body without it is a 400 naming `model`); with
    `gateway.served_model_names` set it must be one of them."""
    messages: Annotated[list[ChatMessage], shapes.CHAT_MESSAGES] = Field(min_length=1)
    temperature: shapes.Number | None = Field(None, ge=0, le=2)
    top_p: shapes.Number | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Stop | None = None
    """Up to 4 stop strings, as in OpenAI's API."""
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1, le=16)
    """Choices per request; in a session each choice is recorded (turns.py)."""
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]] | None, shapes.TOOLS] = Field(None, max_length=128)
    tool_choice: Annotated[str | dict[str, Any] | None, shapes.TOOL_CHOICE] = None
    response_format: Annotated[dict[str, Any] | None, shapes.RESPONSE_FORMAT] = None
    logprobs: StrictBool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Most likely alternatives per token (needs `logprobs: true`)."""
    # Accepted without effect on the sampled tokens.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    parallel_tool_calls: StrictBool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    moderation: Any = None
    modalities: list[Literal["text"]] | None = None
    # Changes sampling: neutral values only (see _NEUTRAL).
    frequency_penalty: Annotated[shapes.Number | None, shapes.neutral(0)] = None
    presence_penalty: Annotated[shapes.Number | None, shapes.neutral(0)] = None
    logit_bias: Annotated[dict[str, shapes.Number] | None, shapes.neutral({})] = None
    prediction: Annotated[Any, shapes.ONLY_NULL] = None
    audio: Annotated[Any, shapes.ONLY_NULL] = None
    web_search_options: Annotated[Any, shapes.ONLY_NULL] = None
    functions: Annotated[list[Any] | None, shapes.neutral([])] = None
    function_call: Annotated[Any, shapes.ONLY_NULL] = None
    # SGLang extensions accepted as top-level keys (the SDK's extra_body).
    top_k: Annotated[int | None, shapes.TOP_K] = Field(None, ge=-1, le=shapes.TOP_K_MAX)
    min_p: shapes.Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Annotated[shapes.Number | None, shapes.neutral(1)] = None
    min_tokens: Annotated[shapes.Int | None, shapes.neutral(0)] = None
    ignore_eos: Annotated[StrictBool | None, shapes.neutral(False)] = None
    stop_token_ids: Annotated[list[shapes.Int] | None, shapes.neutral([])] = None
    regex: str | None = None
    json_schema: Any = None
    ebnf: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, shapes.neutral({})] = None
    separate_reasoning: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None

    @field_validator(
        "max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs", "top_k", mode="before"
    )
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return shapes.integer(v)  # no "10" or true as an integer

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        """`"n": null` and `"stream": null` mean the default, as in OpenAI's API."""
        if v is None:
            assert info.field_name is not None  # set for a field validator
            return cls.model_fields[info.field_name].default
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            fn = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters", {}), dict | None)
            ):
                raise ValueError(
                    f'tool {i} must be {{"type": "function", "function": {{"name": '
                    'a string, "description" (optional): a string, "parameters" (optional): '
                    "a JSON schema}}"
                )
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is None or v in ("auto", "none", "required"):
            return v  # "required": a forced call (api/constraints.py)
        if isinstance(v, dict):
            fn = v.get("function")
            if (
                v.get("type") == "function"
                and isinstance(fn, dict)
                and isinstance(fn.get("name"), str)
            ):
                return v
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required' or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {shown(v)}'
        )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or a positive integer")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (v or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(
                f"response_format type {quoted(kind)} is not one of 'text', 'json_object' or "
                "'json_schema'"
            )
        return v

    @field_validator(*_NEUTRAL, mode="after")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None  # set for a field validator
        if v not in _NEUTRAL[info.field_name]:
            raise ValueError(
                f"{info.field_name} is not supported by the engine (got {shown(v)}); leave it unset"
            )
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_cap(cls, v: int | None, info: ValidationInfo) -> int | None:
        given = info.data.get("max_tokens")
        if None not in (v, given) and v != given:
            raise ValueError(
                f"max_tokens ({given}) and max_completion_tokens ({v}) disagree; "
                "send only max_completion_tokens"
            )
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError(
                f"top_logprobs ({v}) needs logprobs: true (as in OpenAI's API); "
                "set logprobs or drop top_logprobs"
            )
        return v

    @property
    def tools_offered(self) -> bool:
        """Whether the model may call a tool: tools given and `tool_choice` not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def sampling_params(
        self, default_max_tokens: int, tool_parser: str = "hermes"
    ) -> dict[str, Any]:
        """SGLang `sampling_params` for this request (only keys SGLang accepts), with the
        grammar param of a forced tool call or structured output (api/constraints.py).

        Raises:
            InvalidRequestError: a forced call without (or naming no) tool, a malformed
                json_schema response_format, or two constraints at once.
        """
        params = sglang_sampling(
            self, self.max_completion_tokens or self.max_tokens or default_max_tokens
        )
        params.update(grammar_params(self, tool_parser))
        return params


def stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's `stop` (a string, a list or null) as a list of stop strings."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def sglang_sampling(req: Any, max_new_tokens: int) -> dict[str, Any]:
    """SGLang `sampling_params` from an OpenAI request's `temperature`, `top_p`, `top_k`,
    `min_p`, `stop` and `seed` (unset ones get SGLang's neutral values; the seed, a signed int64
    in OpenAI's API, becomes SGLang's non-negative `sampling_seed`)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
    }
    if req.stop:
        params["stop"] = stop_list(req.stop)
    if req.seed is not None:
        params["sampling_seed"] = req.seed % 2**63
    return params


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(None, pattern=f"^{SESSION_ID_PATTERN.pattern}$")
    group_id: str = Field("", max_length=256)
    task: dict[str, Any] = Field(default_factory=dict)
    """Task metadata for the reward service, e.g. {"answer": "8", "verifier": "last_integer"}."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["episode", "live"] = "episode"
    eval: StrictBool = False
    """Evaluation sessions are served normally but never published as training data."""


class NextState(ChatMessage):
    """What followed a live turn (finish body): a message as in a chat request, except that a
    tool result may leave out its `tool_call_id` (it is stored, not rendered for the engine)."""

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v


class SessionFinish(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: shapes.Number | None = None
    """Outcome reward posted by the environment; combined with the others by the reward service."""
    next_state: Annotated[NextState | None, shapes.NEXT_STATE] = None
    """Live mode: what followed the last turn (e.g. the user's final reply), if anything."""


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: shapes.Number
    """The environment's reward; stored as `rewards[name]` of the session's next Sample."""
    name: str = Field("outcome", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """Reward component name (the reward service weights components by name)."""
