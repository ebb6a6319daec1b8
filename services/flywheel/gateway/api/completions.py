"""OpenAI `POST /v1/completions`: a raw prompt (text or token ids) straight to the engine.

No chat template is applied: a text prompt is tokenized as it stands (no special tokens added),
token-id prompts go to the engine unchanged. Without a session nothing is recorded (a batch of
prompts and `n` > 1 are served). In a session (`/s/<id>/v1/completions` or `X-Session-Id`, one
prompt, n = 1) each call is recorded into the session's segment, token-faithfully: a prompt that
starts with the segment's recorded text (text prompts) or ids (id prompts) appends only the rest
after the recorded ids. Episode mode: any other prompt starts a new segment (counted as a fork,
`history_edited`). Live mode, as for chat (turns.py, branches.py): each call is one Sample,
published when a later prompt extends its recorded text or ids (the rest of that prompt, as a
user message, is its `next_state`) or at finish; a prompt that extends an earlier turn instead
is a branch that continues that turn's ids.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from prometheus_client import Counter
from pydantic import ConfigDict, Field, StrictBool, ValidationInfo, WithJsonSchema, field_validator

from flywheel.core.errors import InvalidRequestError
from flywheel.core.validation_messages import shown
from flywheel.gateway.api import json_shapes as shapes
from flywheel.gateway.api.request_rules import served_models
from flywheel.gateway.api.schemas import Stop, StreamOptionsNeedStream, sglang_sampling
from flywheel.gateway.engines import calls
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.recording.history import count_fork, sampling_changed, set_sampling
from flywheel.gateway.recording.records import PendingTurn, Segment, SegmentSample, SessionRecord
from flywheel.gateway.session import branches, turns
from flywheel.gateway.session.backpressure import served_unrecorded
from flywheel.gateway.session.locks import locked
from flywheel.gateway.session.owner import REQUEST_TRAIN

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

UNRECORDED = Counter(
    "flywheel_gateway_unrecorded_completions_total", "Raw completions served without a session"
)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            _IDS,
            {"type": "array", "items": _IDS, "minItems": 1},
        ]
    }
)
"""A text prompt, a batch of them, one id prompt, or a batch of id prompts; none empty (ids
below the vocabulary size: `json_shapes.document_limits`)."""


class CompletionRequest(StreamOptionsNeedStream):
    """`POST /v1/completions` body; unrecognized fields are a 400 (as in chat completions)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        json_schema_extra={
            "dependentSchemas": {
                **shapes.STREAM_OPTIONS_NEED_STREAM,
                "best_of": {"properties": {"n": {"const": 1}}},  # documented: best_of = n = 1
            }
        },
    )

    model: str
    """Required, as in OpenAI's API (a body without it is a 400 naming `model`)."""
    prompt: Annotated[str | list[str] | list[shapes.Int] | list[list[shapes.Int]], PROMPT]
    max_tokens: int | None = Field(None, ge=1)
    """Completion tokens; OpenAI's default is 16."""
    temperature: shapes.Number | None = Field(None, ge=0, le=2)
    top_p: shapes.Number | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    best_of: Annotated[int | None, WithJsonSchema(shapes.nullable({"const": 1}))] = Field(
        None, ge=1, le=16
    )
    stop: Stop | None = None
    """Up to 4 stop strings, as in OpenAI's API."""
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    """Alternatives per token in `choices[].logprobs.top_logprobs` (0 = chosen tokens only)."""
    user: str | None = None
    echo: Annotated[StrictBool | None, shapes.neutral(False)] = None
    suffix: Annotated[str | None, shapes.neutral("")] = None
    frequency_penalty: Annotated[shapes.Number | None, shapes.neutral(0)] = None
    presence_penalty: Annotated[shapes.Number | None, shapes.neutral(0)] = None
    logit_bias: Annotated[dict[str, shapes.Number] | None, shapes.neutral({})] = None
    top_k: Annotated[int | None, shapes.TOP_K] = Field(None, ge=-1)
    min_p: shapes.Number | None = Field(None, ge=0, le=1)

    @field_validator("max_tokens", "n", "best_of", "seed", "logprobs", "top_k", mode="before")
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return shapes.integer(v)  # no "10" or true as an integer

    @field_validator(*_NEUTRAL, mode="after")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None  # set for a field validator
        if v not in _NEUTRAL[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported (got {shown(v)}); leave it unset")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError(
                "prompt needs at least one token or string (an empty list or an "
                "empty id list has nothing to complete)"
            )
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported (every choice is returned)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (whole vocabulary) or a positive integer")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch (one for a single string or id list)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]  # narrowed above
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> dict[str, Any]:
        """SGLang `sampling_params` (OpenAI's legacy default of 16 new tokens)."""
        return sglang_sampling(self, self.max_tokens or 16)


def _ids(d: GatewayDeps, prompt: str | list[int]) -> list[int]:
    ids = d.renderer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    vocab = len(d.renderer.tokenizer)
    if not ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    return ids


async def complete(
    d: GatewayDeps, body: CompletionRequest, session_id: str | None
) -> dict[str, Any]:
    """Serve (and in a session, record) a completions request; returns the response body."""
    sampling = body.sampling_params()
    prompts = body.prompts()
    if session_id is not None and not REQUEST_TRAIN.get():  # not for training: unrecorded
        result = await complete(d, body, None)
        served_unrecorded(session_id, "not_for_training", result["usage"]["completion_tokens"])
        return result
    if session_id is not None:
        if len(prompts) != 1 or body.n != 1:
            raise InvalidRequestError(
                "a session records one prompt and one choice per call",
                param="n" if body.n != 1 else "prompt",
            )
        gen, n_prompt = await _session_completion(d, body, session_id, prompts[0], sampling)
        return _response(d, body, [[gen]], n_prompt)
    UNRECORDED.inc()
    all_ids = [await asyncio.to_thread(_ids, d, p) for p in prompts]
    for ids in all_ids:
        calls.check_context(d, ids, sampling, param="prompt")
    gens = await asyncio.gather(
        *[calls.generate_n(d, ids, sampling, body.n, body.logprobs or 0) for ids in all_ids]
    )
    return _response(d, body, list(gens), sum(len(i) for i in all_ids))


async def _session_completion(
    d: GatewayDeps,
    body: CompletionRequest,
    session_id: str,
    prompt: str | list[int],
    sampling: dict[str, Any],
) -> tuple[Generation, int]:
    async with locked(d.sessions, session_id) as record:
        if record.status != "open":
            raise turns.finished_error(record)
        out: list[turns.Due] = []
        if record.mode == "live":
            out += _select_branch(d, record, prompt)
        closed = await asyncio.to_thread(_extend, d, record, prompt, sampling)
        if closed is not None and record.mode == "episode":
            out.append(SegmentSample(segment=closed))
        seg = record.segment
        calls.check_context(d, seg.token_ids, sampling, param="prompt")
        turns.check_held(d, record, len(out))
        (gen,) = await calls.generate_n(
            d, list(seg.token_ids), sampling, 1, body.logprobs or 0, affinity=session_id
        )
        seg.turn_start = len(seg.token_ids)
        seg.append(
            gen.output_ids,
            sampled=True,
            logprobs=gen.output_logprobs,
            versions=gen.token_versions(),
            renormalized=gen.renormalized,
        )
        prompt_text = prompt if isinstance(prompt, str) else d.renderer.decode(prompt)
        seg.text = prompt + _context_text(d, gen) if isinstance(prompt, str) else ""
        seg.messages = [
            {"role": "user", "content": prompt_text},
            {"role": "assistant", "content": gen.text},
        ]
        seg.turns += 1
        seg.finish_reason = gen.finish_type
        seg.ended_with_eos = gen.matched_eos
        seg.mark_turn()
        set_sampling(seg, sampling)
        turn = record.turns
        record.turns += 1
        if record.mode == "live":
            turns.store_turn(record, seg, turn)
        n_prompt = seg.turn_start
        turns.publish(d, record, out)
        return gen, n_prompt


def _continues(prompt: str | list[int]) -> Callable[[Segment, int], bool]:
    """Whether `prompt` starts with a segment's recorded text (text prompts) or ids (id
    prompts) as they were right after its turn `k` (`branches.Continues`)."""

    def check(seg: Segment, k: int) -> bool:
        cp = seg.checkpoints[k]
        if isinstance(prompt, str):
            return cp.text > 0 and prompt.startswith(seg.text[: cp.text])
        return len(prompt) >= cp.tokens and prompt[: cp.tokens] == seg.token_ids[: cp.tokens]

    return check


def _select_branch(
    d: GatewayDeps, record: SessionRecord, prompt: str | list[int]
) -> list[turns.Due]:
    """Live mode: continue the branch the prompt extends; the text after a waiting turn's
    recorded text (or ids) is that turn's next state, as a user message."""

    def emit(turn: PendingTurn, seg: Segment, follows: bool) -> list[turns.Due]:
        if not follows:
            return turns.emit_turn(record, turn, seg, [])
        rest = (
            prompt[len(seg.text) :]
            if isinstance(prompt, str)
            else d.renderer.decode(prompt[len(seg.token_ids) :])
        )
        return turns.emit_turn(
            record, turn, seg, [{"role": "user", "content": rest}] if rest else []
        )

    return branches.select(record, _continues(prompt), emit)


def _context_text(d: GatewayDeps, gen: Generation) -> str:
    """The text the recorded ids add to the context: the reply's text, except after a stop
    string, where the ids keep the whole token that completed it (the stop string included,
    and what the token holds past it) while the reply's text ends before the stop string.

    Example: stop "he", sampled token " there": the reply is " t", the context text " there";
    a next prompt "... t Then" does not extend it (a new segment, tokenized as it stands), and
    "... there Then" does.
    """
    return d.renderer.decode(gen.output_ids) if isinstance(gen.matched, str) else gen.text


def _extend(
    d: GatewayDeps, record: SessionRecord, prompt: str | list[int], sampling: dict[str, Any]
) -> Segment | None:
    """Append the prompt's new part to the segment, or fork (history edited, or an episode's
    sampling changed); returns the closed segment."""
    seg = record.segment
    if sampling_changed(record, sampling):
        count_fork(record, "sampling_changed")
    elif seg.turns:
        if isinstance(prompt, str) and seg.text and prompt.startswith(seg.text):
            rest = prompt[len(seg.text) :]
            seg.append(d.renderer.encode(rest) if rest else [], sampled=False)
            return None
        if not isinstance(prompt, str) and prompt[: len(seg.token_ids)] == seg.token_ids:
            seg.append(_ids(d, prompt)[len(seg.token_ids) :], sampled=False)
            return None
        count_fork(record, "history_edited")
    closed = seg if seg.sampled_tokens else None
    record.segment = seg = Segment(index=seg.index + 1 if seg.turns else seg.index)
    ids = _ids(d, prompt)
    seg.append(ids, sampled=False)
    seg.prompt_length = len(ids)
    return closed


def _logprobs(d: GatewayDeps, gen: Generation, top: int) -> dict[str, Any]:
    tokens = [d.renderer.tokenizer.decode([t]) for t in gen.output_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops = gen.output_top_logprobs or [[] for _ in tokens]
    return {
        "tokens": tokens,
        "token_logprobs": list(gen.output_logprobs),
        "top_logprobs": [
            {d.renderer.tokenizer.decode([i]): lp for lp, i in row[:top]} for row in tops
        ]
        if top
        else None,
        "text_offset": offsets,
    }


def _response(
    d: GatewayDeps, body: CompletionRequest, gens: list[list[Generation]], prompt_tokens: int
) -> dict[str, Any]:
    choices = []
    for i, gen in enumerate(g for per_prompt in gens for g in per_prompt):
        choices.append(
            {
                "index": i,
                "text": gen.text,
                "finish_reason": gen.finish_type,
                "logprobs": None if body.logprobs is None else _logprobs(d, gen, body.logprobs),
            }
        )
    completion = sum(len(g.output_ids) for per_prompt in gens for g in per_prompt)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model or served_models(d.settings)[0],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }


def sse_chunks(completion: dict[str, Any], include_usage: bool) -> list[str]:
    """SSE events of a finished `text_completion`: one chunk per choice, usage, [DONE]."""
    base = {k: completion[k] for k in ("id", "object", "created", "model")}
    events = [f"data: {json.dumps({**base, 'choices': [c]})}\n\n" for c in completion["choices"]]
    if include_usage:
        events.append(
            f"data: {json.dumps({**base, 'choices': [], 'usage': completion['usage']})}\n\n"
        )
    events.append("data: [DONE]\n\n")
    return events
