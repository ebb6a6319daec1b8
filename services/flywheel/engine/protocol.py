"""Wire shapes of the SGLang native HTTP API subset the engine serves (torch-free).

Request models mirror SGLang 0.5.23 (`io_struct.py::GenerateReqInput`, `sampling_params.py`):
unknown top-level keys are ignored, unknown `sampling_params` keys are rejected (the 0.5.22+
contract gate). `expand_generate()` turns one /generate body into per-row `RowSpec`s (batch and
`n` expanded, per-request fields broadcast). Responses are plain dicts built by
`generate_response()`; `dumps()` serializes them like orjson (NaN/inf -> null).

Keys SGLang knows but this engine does not implement (penalties, logit_bias, stop_regex,
min_new_tokens) are accepted only at their neutral values, and rejected otherwise. The grammar
keys (`json_schema`, `regex`, `ebnf`, `structural_tag`; at most one) are compiled by
`engine/grammar.py` when the row is submitted.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flywheel.core.errors import InvalidRequestError

_NEUTRAL = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "logit_bias": None,
}


class SamplingParams(BaseModel):
    """SGLang `sampling_params`; defaults are SGLang's constants, not generation_config's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = Field(128, ge=0)
    """Tokens to generate; 0 = prefill only (scoring); None = up to the context length."""
    temperature: float = Field(1.0, ge=0)
    """[0, 1e-6) = greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = 1 << 30
    """-1 or 1<<30 = all tokens; 0 is an error."""
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    """Strings matched on the detokenized output (at most 32)."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1)
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream_interval: int | None = Field(None, ge=1)
    """Streaming: sampled tokens per chunk (the final chunk always comes); None = 1."""
    custom_params: dict[str, Any] | None = None
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    """A JSON Schema (as a string) the output must satisfy (constrained decoding)."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    ebnf: str | None = None
    """An EBNF grammar (xgrammar dialect, rule `root`) the output must match."""
    structural_tag: str | None = None
    """An xgrammar structural tag (JSON), e.g. a tool call's begin/end around a JSON schema."""
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (all) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 32:
            raise ValueError("at most 32 stop strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingParams:
        grammars = [self.json_schema, self.regex, self.ebnf, self.structural_tag]
        if sum(g is not None for g in grammars) > 1:
            raise ValueError("Only one of regex, json_schema, ebnf or structural_tag can be set.")
        for key, neutral in _NEUTRAL.items():
            if getattr(self, key) != neutral:
                raise ValueError(
                    f"{key}={getattr(self, key)!r} is not supported by the embedded engine"
                )
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    @property
    def constrained(self) -> bool:
        """Whether a grammar (json_schema, regex, ebnf or structural_tag) is set."""
        return any(
            g is not None for g in (self.json_schema, self.regex, self.ebnf, self.structural_tag)
        )


class GenerateRequest(BaseModel):
    """`POST /generate` body. Exactly one of `text` / `input_ids`."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    """Validated per entry by `expand_generate` (so errors name the offending key)."""
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    """Logprobs of these vocabulary ids at every scored position (per row when nested)."""
    return_text_in_logprobs: bool = False
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        return self


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


@dataclass
class RowSpec:
    """One prompt of a /generate call after batch and `n` expansion."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    token_ids_logprob: list[int] | None = None


def _per_row(value: Any, size: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * size
    if isinstance(value, list):
        if len(value) != size:
            raise InvalidRequestError(f"{name} has {len(value)} entries for a batch of {size}")
        return [default if v is None else v for v in value]
    return [value] * size


def expand_generate(req: GenerateRequest) -> tuple[list[RowSpec], bool]:
    """Per-row specs of a /generate body, prompt-major (row i*n + j), and whether it is a batch.

    Raises:
        pydantic.ValidationError: a sampling_params entry is invalid (unknown key, bad value).
        InvalidRequestError: empty prompt, list lengths that do not match the batch.
    """
    if req.text is not None:
        prompts: list[Any] = req.text if isinstance(req.text, list) else [req.text]
        is_batch = isinstance(req.text, list)
    else:
        ids = req.input_ids or []
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
    if not prompts or (req.input_ids is not None and any(len(p) == 0 for p in prompts)):
        raise InvalidRequestError("the prompt is empty")
    size = len(prompts)
    raw = _per_row(req.sampling_params, size, "sampling_params", {})
    params = [SamplingParams.model_validate(p) for p in raw]
    n = params[0].n
    if any(p.n != n for p in params):
        raise InvalidRequestError("all sampling_params in a batch must have the same n")
    if req.rid is None:
        rids = [uuid.uuid4().hex for _ in range(size)]
    elif isinstance(req.rid, list):
        rids = _per_row(req.rid, size, "rid", None)
    else:
        rids = [req.rid] if size == 1 and n == 1 else [f"{req.rid}_{i}" for i in range(size * n)]
    columns = {
        "return_logprob": _per_row(req.return_logprob, size, "return_logprob", False),
        "logprob_start_len": _per_row(req.logprob_start_len, size, "logprob_start_len", -1),
        "top_logprobs_num": _per_row(req.top_logprobs_num, size, "top_logprobs_num", 0),
    }
    token_ids = req.token_ids_logprob
    if token_ids and isinstance(token_ids[0], list):
        per_prompt_ids = _per_row(token_ids, size, "token_ids_logprob", None)
    else:
        per_prompt_ids = [token_ids] * size
    rows: list[RowSpec] = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            k = i * n + j
            rid = rids[k] if len(rids) == size * n else rids[i] if n == 1 else f"{rids[i]}_{j}"
            rows.append(
                RowSpec(
                    rid=rid,
                    text=prompt if isinstance(prompt, str) else None,
                    input_ids=None if isinstance(prompt, str) else list(prompt),
                    params=params[i],
                    return_logprob=columns["return_logprob"][i],
                    logprob_start_len=columns["logprob_start_len"][i],
                    top_logprobs_num=columns["top_logprobs_num"][i],
                    return_text_in_logprobs=req.return_text_in_logprobs,
                    token_ids_logprob=per_prompt_ids[i],
                )
            )
    return rows, is_batch or n > 1


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def dumps(obj: Any) -> bytes:
    """JSON like SGLang's orjson responses: non-finite floats become null, tuples arrays."""
    return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":")).encode()


def validation_message(exc: Exception) -> str:
    """One line from a pydantic ValidationError (or any exception) for a 400 body."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for e in errors():
            loc = ".".join(str(p) for p in e.get("loc", ()))
            msg = str(e.get("msg")).removeprefix("Value error, ")  # a check's own ValueError
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts)
    return str(exc)
