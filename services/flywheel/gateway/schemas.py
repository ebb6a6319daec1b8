"""HTTP request models of the gateway (OpenAI chat completions and Flywheel sessions).

Unknown fields are ignored (as SGLang's OpenAI server does, so SDK `extra_body` keys pass);
invalid values fail validation and are answered with OpenAI error JSON (core/http_errors.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""Session ids a client may choose (URL prefix, `X-Session-Id`, `POST /v1/sessions`)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (content parts joined to text)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(
                p.get("text", "") for p in self.content if p.get("type") in ("text", "input_text")
            )
        if data["role"] == "developer":
            data["role"] = "system"
        data.setdefault("content", "")
        return data


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, max_length=32)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1, le=16)
    """Choices per request (served without a session; one engine call per choice)."""
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    # SGLang extensions accepted as top-level keys (the SDK's extra_body).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or a positive integer")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(
                f"response_format type {kind!r} is not supported by this engine; use 'text'")
        return self

    def sampling_params(self, default_max_tokens: int) -> dict[str, Any]:
        """SGLang `sampling_params` for this request (only keys SGLang accepts)."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_completion_tokens or self.max_tokens or default_max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
        }
        if self.stop:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.seed is not None:
            params["sampling_seed"] = self.seed % 2**63  # OpenAI seeds are signed int64
        return params


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(None, pattern=f"^{SESSION_ID_PATTERN.pattern}$")
    group_id: str = Field("", max_length=256)
    task: dict[str, Any] = Field(default_factory=dict)
    """Task metadata for the reward service, e.g. {"answer": "8", "verifier": "last_integer"}."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["episode", "live"] = "episode"
    eval: bool = False
    """Evaluation sessions are served normally but never published as training data."""


class SessionFinish(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float | None = None
    """Outcome reward posted by the environment; combined with the others by the reward service."""
    next_state: ChatMessage | None = None
    """Live mode: what followed the last turn (e.g. the user's final reply), if anything."""


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float
    """The environment's reward; stored as `rewards[name]` of the session's next Sample."""
    name: str = Field("outcome", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    """Reward component name (the reward service weights components by name)."""
