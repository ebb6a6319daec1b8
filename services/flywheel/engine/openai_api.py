"""SGLang's OpenAI-compatible request models and response shapes (torch-free).

Mirrors SGLang 0.5.23 `entrypoints/openai/protocol.py`, `serving_chat.py` and
`serving_completions.py` for the subset the embedded engine serves:

* `/v1/chat/completions`: messages rendered with the model's chat template; sampling defaults
  from the model's `generation_config.json` where the request leaves a field null (chat only, as
  in SGLang); `max_completion_tokens` wins over the deprecated `max_tokens`, null = up to the
  context length; SGLang's top-level extensions (top_k, min_p, stop_token_ids, ignore_eos,
  no_stop_trim, skip_special_tokens, rid, return_token_ids, return_meta_info).
* `/v1/completions`: prompt text or token ids (single or batch), `max_tokens` default 16,
  `logprobs: k` legacy format, `echo`.

Constrained decoding as in SGLang: chat `response_format` `json_schema` (its `schema`) and
`json_object` (`{"type": "object"}`) become the `json_schema` sampling param, `structural_tag`
the `structural_tag` param; top-level `regex` / `ebnf` (and `json_schema` on completions) pass
through; more than one is a 400. Unknown keys are ignored (pydantic extra="ignore", as SGLang);
values the engine cannot honour (penalties, tools) are refused with a 400 rather than silently
dropped.
Responses are plain dicts built from the native /generate result objects (`meta_info`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.engine.protocol import RowSpec, SamplingParams

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
"""Native finish_reason.type -> OpenAI finish_reason."""


class OpenAIError(Exception):
    """An error answered as SGLang's OpenAI envelope
    `{"object":"error","message","type","param","code"}`."""

    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type_

    def body(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.type,
            "param": None,
            "code": self.status,
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = "default"
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions (top level)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    return_token_ids: bool = False
    regex: str | None = None
    ebnf: str | None = None

    def grammar(self) -> dict[str, str]:
        """The constrained-decoding sampling params this request asks for (SGLang's keys)."""
        return {k: v for k, v in (("regex", self.regex), ("ebnf", self.ebnf)) if v is not None}

    def sampling(self, defaults: dict[str, Any], max_new_tokens: int | None) -> SamplingParams:
        """Native sampling params; `defaults` fills fields the request left null."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name, None)
            if value is None:
                value = defaults.get(name)
            return fallback if value is None else value

        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self.logit_bias or None,
            min_new_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            n=self.n,
            sampling_seed=self.seed,
            **self.grammar(),
        )

    @model_validator(mode="after")
    def _stream_only_fields(self) -> _Common:
        if self.stream and self.return_token_ids:
            raise ValueError("return_token_ids is not supported with stream")
        return self


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions` body (SGLang `ChatCompletionRequest`)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    return_meta_info: bool = False

    def grammar(self) -> dict[str, str]:
        """`regex` / `ebnf` plus the `response_format` constraint, as SGLang maps it.

        Raises:
            ValueError: an unknown response_format type, or json_schema without a schema.
        """
        params = super().grammar()
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs json_schema.schema (object)")
            params["json_schema"] = json.dumps(spec["schema"])
        elif kind == "json_object":
            params["json_schema"] = '{"type": "object"}'
        elif kind == "structural_tag":
            params["structural_tag"] = json.dumps(fmt)
        elif kind not in ("text", None):
            raise ValueError(
                f"response_format type {kind!r} is not one of text, json_object, json_schema, "
                "structural_tag"
            )
        return params

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        self.grammar()  # a malformed response_format is a 400 before anything is rendered
        if self.tool_choice not in (None, "none", "auto") or (self.tools and self.tool_choice):
            raise ValueError("tool calling needs a tool-call parser; this engine has none")
        if self.stream and self.return_meta_info:
            raise ValueError("return_meta_info is not supported with stream")
        return self

    def new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class CompletionRequest(_Common):
    """`POST /v1/completions` body (SGLang `CompletionRequest`)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = 1.0
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    json_schema: str | None = None

    def grammar(self) -> dict[str, str]:
        """`regex` / `ebnf` / `json_schema` as given (SGLang's completion extras)."""
        params = super().grammar()
        if self.json_schema is not None:
            params["json_schema"] = self.json_schema
        return params

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of other than n is not supported")
        if self.prompt == [] or self.prompt == "":
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]  # list[int] checked above
        return list(p)  # type: ignore[arg-type]  # list[str] | list[list[int]]


def row_specs(
    prompts: list[str | list[int]],
    params: SamplingParams,
    *,
    rid: str | None,
    return_logprob: bool,
    top_logprobs_num: int,
    logprob_start_len: int = -1,
) -> list[RowSpec]:
    """Rows for `prompts` x `n` (prompt-major, like /generate), rids `{rid}_{i}` when several."""
    base = rid or uuid.uuid4().hex
    total = len(prompts) * params.n
    rows = []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            k = i * params.n + j
            rows.append(
                RowSpec(
                    rid=base if total == 1 else f"{base}_{k}",
                    text=prompt if isinstance(prompt, str) else None,
                    input_ids=None if isinstance(prompt, str) else list(prompt),
                    params=params,
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num,
                    return_text_in_logprobs=True,
                )
            )
    return rows


def usage(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """OpenAI usage; prompt tokens counted once per prompt (not per `n` copy), as SGLang."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results[::n])
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    """(OpenAI finish_reason, matched_stop) of a native meta_info."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return FINISH.get(reason["type"], reason["type"]), reason.get("matched")


def _token_entry(row: list[Any]) -> dict[str, Any]:
    text = row[2] or ""
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": _lp(row[0])}


def _lp(value: float | None) -> float:
    """OpenAI logprobs are numbers: a non-finite (null) value becomes -9999.0 as in OpenAI."""
    return -9999.0 if value is None else value


def chat_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any] | None:
    """`choice.logprobs` of a chat choice from output rows `start..` (OpenAI format, no ids)."""
    rows = meta.get("output_token_logprobs")
    if rows is None:
        return None
    tops = meta.get("output_top_logprobs") or [None] * len(rows)
    content = []
    for row, top in zip(rows[start:], tops[start:], strict=True):
        entry = _token_entry(row)
        entry["top_logprobs"] = [_token_entry(t) for t in (top or [])]
        content.append(entry)
    return {"content": content}


def chat_response(
    req: ChatCompletionRequest,
    results: list[dict[str, Any]],
    prompt_ids: list[int],
    weight_version: str,
) -> dict[str, Any]:
    """The non-streaming `chat.completion` object."""
    choices = []
    for i, r in enumerate(results):
        meta = r["meta_info"]
        reason, matched = finish(meta)
        choice: dict[str, Any] = {
            "index": i,
            "message": {
                "role": "assistant",
                "content": r["text"],
                "reasoning_content": None,
                "tool_calls": None,
            },
            "logprobs": chat_logprobs(meta) if req.logprobs else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if req.return_token_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["response_token_ids"] = r["output_ids"]
        if req.return_meta_info:
            choice["meta_info"] = meta
        choices.append(choice)
    return {
        "id": results[0]["meta_info"]["id"].rsplit("_", 1)[0]
        if len(results) > 1
        else (results[0]["meta_info"]["id"]),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(results, req.n),
        "metadata": {"weight_version": weight_version},
    }


def completion_logprobs(meta: dict[str, Any], *, echo: bool, start: int = 0) -> dict[str, Any]:
    """Legacy `choice.logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    rows = list(meta.get("input_token_logprobs") or []) if echo and start == 0 else []
    tops: list[Any] = list(meta.get("input_top_logprobs") or [None] * len(rows))
    rows += meta.get("output_token_logprobs", [])[start:]
    tops += (meta.get("output_top_logprobs") or [None] * len(rows))[start:]
    tops = tops[: len(rows)] + [None] * (len(rows) - len(tops))
    offsets, pos = [], 0
    for row in rows:
        offsets.append(pos)
        pos += len(row[2] or "")
    return {
        "tokens": [row[2] or "" for row in rows],
        "token_logprobs": [row[0] for row in rows],
        "top_logprobs": [
            None if top is None else {t[2] or "": _lp(t[0]) for t in top} for top in tops
        ],
        "text_offset": offsets,
    }


def completion_response(
    req: CompletionRequest,
    results: list[dict[str, Any]],
    prompt_texts: list[str],
    weight_version: str,
) -> dict[str, Any]:
    """The non-streaming `text_completion` object."""
    choices = []
    for i, r in enumerate(results):
        meta = r["meta_info"]
        reason, matched = finish(meta)
        text = r["text"]
        if req.echo:
            text = prompt_texts[i // req.n] + text
        choice: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": (
                completion_logprobs(meta, echo=req.echo) if req.logprobs is not None else None
            ),
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if req.return_token_ids:
            choice["token_ids"] = r["output_ids"]
        choices.append(choice)
    return {
        "id": uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(results, req.n),
        "metadata": {"weight_version": weight_version},
    }


def model_card(name: str, context_length: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": context_length,
    }
