"""SGLang's OpenAI-compatible routes on the embedded engine.

`/v1/chat/completions` (non-stream and SSE stream), `/v1/completions` (non-stream and stream),
`/v1/models`, `/v1/models/{model}`, `/v1/tokenize` and `/v1/detokenize` (also without /v1).
Requests become native rows (`RowSpec`) submitted to the same engine as /generate, so a judge
or teacher pointed at `http://host:port/v1` gets exactly what an SGLang server would give it.
Errors use SGLang's OpenAI envelope (`openai_api.OpenAIError`); a body that is not
`application/json` is a 400 as in SGLang.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from flywheel.core.errors import PlatformError
from flywheel.engine.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    finish,
    model_card,
    row_specs,
    usage,
)
from flywheel.engine.protocol import dumps, validation_message

if TYPE_CHECKING:
    from flywheel.engine.app import EngineDeps


async def _json_body(request: Request) -> dict[str, Any]:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("application/json"):
        raise OpenAIError("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        data = json.loads(await request.body())
    except json.JSONDecodeError as e:
        raise OpenAIError(f"invalid JSON body: {e}") from e
    if not isinstance(data, dict):
        raise OpenAIError("the JSON body must be an object")
    return data


def _validate(model: Any, data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise OpenAIError(validation_message(e)) from e


def _tokenizer(d: EngineDeps) -> Any:
    tok = d.engine.tokenizer
    if tok is None:
        raise OpenAIError(f"the engine is {d.engine.status}", 503, "ServiceUnavailableError")
    return tok


def render_chat(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Prompt ids of a chat request: the model's chat template, generation prompt appended.

    Raises:
        OpenAIError: the template rejects the messages (400).
    """
    messages = [{**m, "content": m.get("content") or ""} for m in req.messages]
    add_prompt = not (req.continue_final_message and messages[-1].get("role") == "assistant")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_prompt,
            continue_final_message=not add_prompt,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja2 raises TemplateError and plain exceptions
        raise OpenAIError(f"the chat template cannot render these messages: {e}") from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def register_openai_routes(app: FastAPI, wait: Any, stream_rows: Any) -> None:
    """Add the /v1 routes. `wait(request, jobs)` awaits final results; `stream_rows(request,
    engine, specs)` submits rows and yields `(row_index, cumulative_result, final)` per new
    token (see app.open_stream)."""
    from flywheel.engine.app import get_deps

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return Response(dumps(exc.body()), status_code=exc.status, media_type="application/json")

    def _open(fn: Any) -> Any:
        try:
            return fn()
        except PlatformError as e:
            raise OpenAIError(e.message, e.http_status, type(e).__name__) from e

    def _submit(d: EngineDeps, specs: list[Any]) -> list[Any]:
        return _open(lambda: d.engine.submit(specs))

    async def _results(request: Request, jobs: list[Any]) -> list[dict[str, Any]]:
        try:
            return await wait(request, jobs)
        except PlatformError as e:
            raise OpenAIError(e.message, e.http_status, type(e).__name__) from e

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        d = get_deps(request)
        req: ChatCompletionRequest = _validate(ChatCompletionRequest, await _json_body(request))
        tokenizer = _tokenizer(d)
        prompt_ids = await asyncio.to_thread(render_chat, tokenizer, req)
        try:
            params = req.sampling(d.engine.generation_defaults, req.new_tokens())
        except ValidationError as e:
            raise OpenAIError(validation_message(e)) from e
        specs = row_specs(
            [prompt_ids],
            params,
            rid=req.rid,
            return_logprob=req.logprobs or req.return_meta_info,
            top_logprobs_num=req.top_logprobs or 0,
        )
        if req.stream:
            rows = _open(lambda: stream_rows(request, d.engine, specs))
            return StreamingResponse(
                _chat_stream(req, rows, specs[0].rid, len(prompt_ids)),
                media_type="text/event-stream",
            )
        jobs = _submit(d, specs)
        results = await _results(request, jobs)
        return Response(
            dumps(chat_response(req, results, prompt_ids, d.engine.weight_version)),
            media_type="application/json",
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        d = get_deps(request)
        req: CompletionRequest = _validate(CompletionRequest, await _json_body(request))
        tokenizer = _tokenizer(d)
        prompts = req.prompts()
        try:
            params = req.sampling({}, req.max_tokens)
        except ValidationError as e:
            raise OpenAIError(validation_message(e)) from e
        specs = row_specs(
            prompts,
            params,
            rid=req.rid,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
        )
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        if req.stream:
            rows = _open(lambda: stream_rows(request, d.engine, specs))
            return StreamingResponse(
                _completion_stream(req, rows, texts), media_type="text/event-stream"
            )
        jobs = _submit(d, specs)
        results = await _results(request, jobs)
        return Response(
            dumps(completion_response(req, results, texts, d.engine.weight_version)),
            media_type="application/json",
        )

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """{"prompt": str | list[str], "add_special_tokens"} or {"messages", ...} ->
        {"tokens", "count", "max_model_len"} (the ids the server itself would use)."""
        d = get_deps(request)
        data = await _json_body(request)
        tokenizer = _tokenizer(d)
        if "messages" in data:
            chat = _validate(ChatCompletionRequest, {**data, "stream": False})
            tokens: Any = await asyncio.to_thread(render_chat, tokenizer, chat)
            count: int | list[int] = len(tokens)
        else:
            prompt = data.get("prompt")
            special = bool(data.get("add_special_tokens", True))
            if isinstance(prompt, str):
                tokens = list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
                count = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [
                    list(tokenizer(p, add_special_tokens=special)["input_ids"]) for p in prompt
                ]
                count = [len(t) for t in tokens]
            else:
                raise OpenAIError("prompt must be a string or a list of strings")
        body = {"tokens": tokens, "count": count, "max_model_len": d.settings.context_length}
        return Response(dumps(body), media_type="application/json")

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        d = get_deps(request)
        data = await _json_body(request)
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise OpenAIError("tokens must be a list of token ids")
        skip = bool(data.get("skip_special_tokens", True))
        text = _tokenizer(d).decode(ids, skip_special_tokens=skip)
        return Response(dumps({"text": text}), media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        d = get_deps(request)
        card = model_card(d.settings.served_model_name, d.settings.context_length)
        return Response(dumps({"object": "list", "data": [card]}), media_type="application/json")

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        d = get_deps(request)
        if model != d.settings.served_model_name:
            raise OpenAIError(f"The model '{model}' does not exist", 404, "model_not_found")
        card = model_card(d.settings.served_model_name, d.settings.context_length)
        return Response(dumps(card), media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def _chat_stream(
    req: ChatCompletionRequest,
    rows: AsyncIterator[tuple[int, dict[str, Any], bool]],
    rid: str,
    prompt_len: int,
) -> AsyncIterator[bytes]:
    """chat.completion.chunk events: role chunk, content deltas, finish chunk, usage, [DONE]."""
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
    sent_text = [""] * req.n
    sent_tokens = [0] * req.n
    finals: list[dict[str, Any] | None] = [None] * req.n
    for i in range(req.n):
        delta = {"role": "assistant", "content": ""}
        yield _sse({**head, "choices": [_choice(i, delta, None, None)]})
    try:
        async for i, result, final in rows:
            text = result["text"]
            new_text = text[len(sent_text[i]) :] if text.startswith(sent_text[i]) else ""
            if new_text or (req.logprobs and len(result["output_ids"]) > sent_tokens[i]):
                lp = chat_logprobs(result["meta_info"], sent_tokens[i]) if req.logprobs else None
                chunk = _choice(i, {"content": new_text}, None, None, lp)
                yield _sse({**head, "choices": [chunk]})
                sent_text[i] = text
                sent_tokens[i] = len(result["output_ids"])
            if final:
                finals[i] = result
                reason, matched = finish(result["meta_info"])
                yield _sse({**head, "choices": [_choice(i, {}, reason, matched)]})
    except PlatformError as e:
        yield _sse({"error": OpenAIError(e.message, e.http_status, type(e).__name__).body()})
        yield b"data: [DONE]\n\n"
        return
    if req.stream_options and req.stream_options.include_usage and all(finals):
        done = [f for f in finals if f is not None]
        yield _sse({**head, "choices": [], "usage": usage(done, req.n)})
    yield b"data: [DONE]\n\n"


def _choice(
    i: int, delta: dict[str, Any], reason: str | None, matched: Any, logprobs: Any = None
) -> dict[str, Any]:
    out = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    if reason is not None:
        out["matched_stop"] = matched
    return out


async def _completion_stream(
    req: CompletionRequest,
    rows: AsyncIterator[tuple[int, dict[str, Any], bool]],
    prompt_texts: list[str],
) -> AsyncIterator[bytes]:
    """text_completion chunks with text deltas, then usage (if asked) and [DONE]."""
    head = {"object": "text_completion", "created": int(time.time()), "model": req.model}
    total = len(prompt_texts) * req.n
    sent_text = [""] * total
    sent_tokens = [0] * total
    finals: list[dict[str, Any] | None] = [None] * total
    rid = ""
    try:
        async for i, result, final in rows:
            rid = rid or result["meta_info"]["id"]
            text = result["text"]
            new_text = text[len(sent_text[i]) :] if text.startswith(sent_text[i]) else ""
            if req.echo and not sent_text[i] and not sent_tokens[i]:
                new_text = prompt_texts[i // req.n] + new_text
            reason, matched = finish(result["meta_info"]) if final else (None, None)
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(result["meta_info"], echo=False, start=sent_tokens[i])
            if new_text or final or lp:
                choice = {"index": i, "text": new_text, "logprobs": lp, "finish_reason": reason}
                if final:
                    choice["matched_stop"] = matched
                yield _sse({"id": rid, **head, "choices": [choice]})
            sent_text[i] = text
            sent_tokens[i] = len(result["output_ids"])
            if final:
                finals[i] = result
    except PlatformError as e:
        yield _sse({"error": OpenAIError(e.message, e.http_status, type(e).__name__).body()})
        yield b"data: [DONE]\n\n"
        return
    if req.stream_options and req.stream_options.include_usage and all(finals):
        done = [f for f in finals if f is not None]
        yield _sse({"id": rid, **head, "choices": [], "usage": usage(done, req.n)})
    yield b"data: [DONE]\n\n"
