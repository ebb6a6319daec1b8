"""`POST /v1/responses` (OpenAI Responses API): one chat turn per request.

The request becomes one chat request (responses_translate.py) served by the chat path
(`chat.serve`: the same session, recording and engine call as `/v1/chat/completions`), and the
chat result becomes a `response` object or its stream events (responses_stream.py).

- Session (docs/sessions.md): the URL's (`/s/<id>/v1/responses`), else `X-Session-Id` or one of
  `gateway.session_headers` (session_keys.py), else `prompt_cache_key` (with
  `gateway.session_from_prompt_cache_key`), else the session of `previous_response_id`'s turn;
  none: served unrecorded. A session first named by a header or `prompt_cache_key` is created in
  live mode.
- `store` (default true): the response's conversation is kept for `previous_response_id`
  (responses_store.py); another key's response id is a 404.
- Errors are OpenAI error JSON; chat's refusals name the Responses parameter (`input`,
  `max_output_tokens`, `text.format`).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from flywheel.core.errors import InvalidRequestError, NotFoundError
from flywheel.core.http_errors import param_of
from flywheel.core.validation_messages import openai_message
from flywheel.gateway.access.principal import owner_of
from flywheel.gateway.api import chat, incremental
from flywheel.gateway.api import responses_stream as stream
from flywheel.gateway.api.constraints import check_schemas
from flywheel.gateway.api.disconnect import Receive, unless_disconnected
from flywheel.gateway.api.json_text import dumps
from flywheel.gateway.api.request_rules import served_models, stale_tool_result
from flywheel.gateway.api.responses_schema import ResponsesRequest
from flywheel.gateway.api.responses_store import ResponseStore, StoredResponse
from flywheel.gateway.api.responses_translate import (
    CHAT_PARAMS,
    chat_request,
    conversation_items,
    new_ids,
    output_items,
)
from flywheel.gateway.api.schemas import ChatCompletionRequest, stop_list
from flywheel.gateway.api.session_keys import session_id_of
from flywheel.gateway.deps import Deps, GatewayDeps, SessionHeader, TurnHeader

log = logging.getLogger(__name__)
_MAX_TOKENS = re.compile(r"\bmax_(?:completion_)?tokens\b")


def as_chat(d: GatewayDeps, data: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request, checked as `/v1/chat/completions` checks one.

    Raises:
        InvalidRequestError: chat's refusal, naming the Responses parameter.
    """
    try:
        body = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_of(first.get("loc", ())) or ""
        head, _, rest = param.partition(".")
        head = head.split("[")[0]
        if head in CHAT_PARAMS:
            param = CHAT_PARAMS[head] + param[len(head) :]
        raise InvalidRequestError(openai_message(first, param or None), param=param) from None
    try:
        chat.check_chat(d, body)
        check_schemas(body, "text.format.schema", "tools[{i}].parameters")
    except InvalidRequestError as exc:
        raise responses_error(exc) from None
    return body


def responses_error(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat refusal in Responses terms: `messages...` -> `input`, `max_tokens` ->
    `max_output_tokens` (param and message), e.g. the context-window refusal
    "prompt (9 tokens) + max_tokens (99999) ..." param "messages" -> "prompt (9 tokens) +
    max_output_tokens (99999) ..." param "input"."""
    param = exc.param
    if param and param.startswith("messages"):
        param = "input"
    elif param in ("max_tokens", "max_completion_tokens"):
        param = "max_output_tokens"
    message = _MAX_TOKENS.sub("max_output_tokens", exc.message)
    return InvalidRequestError(message, param=param, code=exc.code)


def started(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The `response` object before any output (`response.created`), echoing the request."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning or {"effort": None, "summary": None},
        "store": body.stores,
        "temperature": body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def usage(d: GatewayDeps, completion: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    """Responses usage from chat usage. `reasoning_tokens`: the reasoning text's token count
    as the tokenizer reads it (0 without reasoning)."""
    u = completion["usage"]
    thought = len(d.renderer.encode(reasoning)) if reasoning else 0
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": min(thought, u["completion_tokens"])},
        "total_tokens": u["total_tokens"],
    }


class Turn:
    """One Responses request being served: its ids, the chat request and what to store."""

    def __init__(
        self,
        d: GatewayDeps,
        store: ResponseStore,
        body: ResponsesRequest,
        chat_body: ChatCompletionRequest,
        conversation: list[dict[str, Any]],
        owner: str,
        session_id: str | None,
    ):
        self.d, self.store, self.body, self.chat_body = d, store, body, chat_body
        self.conversation, self.owner, self.session_id = conversation, owner, session_id
        self.response_id, self.message_id = new_ids("resp", "msg")
        model = body.model or served_models(d.settings)[0]
        self.started = started(body, self.response_id, model)
        self.response_json = b""
        """The final response object's JSON (set by `finish`): the HTTP body and what is
        stored."""

    async def finish(self, completion: dict[str, Any], streamed: str | None) -> dict[str, Any]:
        """The final `response` object (stored when `store`), from the chat completion and the
        text already streamed (None: none)."""
        (choice,) = completion["choices"]
        message, finish = choice["message"], choice["finish_reason"]
        if streamed is not None and not (message.get("content") or "").startswith(streamed):
            incremental.MISMATCHES.inc()
            log.warning("streamed text %r is not a prefix of the reply %r", streamed[:80], message)
        logprobs = (choice.get("logprobs") or {}).get("content")
        output = output_items(
            message,
            finish,
            self.message_id,
            logprobs=logprobs,
            with_encrypted=self.body.includes("reasoning.encrypted_content"),
            force_message=streamed is not None,
        )
        response = {
            **self.started,
            "status": "incomplete" if finish == "length" else "completed",
            "output": output,
            "usage": usage(self.d, completion, message.get("reasoning_content")),
        }
        if finish == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response_json = dumps(response)
        if self.body.stores:
            reply = {k: v for k, v in message.items() if v is not None or k == "content"}
            await self.store.put(
                self.response_id,
                StoredResponse(self.owner, self.session_id or "", [*self.conversation, reply]),
                self.response_json,
            )
        return response


async def respond(
    d: GatewayDeps,
    store: ResponseStore,
    body: ResponsesRequest,
    owner: str,
    receive: Receive | None,
    url_session: str | None,
    header_id: str | None,
    turn_type: str | None,
) -> Response:
    """One Responses request end to end (see the module docstring), as the routes and the hot
    path (hot_path.py) serve it: `owner` is the key id of the request ("" without
    authentication), `receive` the ASGI receive after the body (a disconnect stops the turn).

    Raises:
        PlatformError: a refused request (400 naming the parameter, 404 for an unknown
            previous_response_id), or see `chat.serve`. ClientClosedError: the client left
            before the answer.
    """
    history: list[dict[str, Any]] = []
    previous = None
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id, owner)
        history = previous.conversation
    data, conversation = chat_request(body, history)
    stale = stale_tool_result(data["messages"])
    if stale is not None:
        raise InvalidRequestError(
            f"No tool call found for function call output with call_id {stale[1]}.",
            param="input",
        )
    chat_body = as_chat(d, data)
    create_owner = None
    session_id = url_session
    if session_id is None:
        session_id = chat.session_header(header_id) or session_id_of(
            d.settings, body.prompt_cache_key
        )
        if session_id is None and previous is not None and previous.session_id:
            session_id = previous.session_id
        create_owner = None if session_id is None else owner
    turn = Turn(d, store, body, chat_body, conversation, owner, session_id)
    work = chat.serve(d, chat_body, session_id, turn_type, create_owner=create_owner)
    try:
        if incremental.eligible(chat_body, d.settings.tool_parser):
            feed = incremental.TextFeed(stop_list(chat_body.stop), chat_body.tools_offered)
            streamed = await stream.respond(
                work, receive, session_id, feed, turn.started, turn.message_id, turn.finish
            )
            if isinstance(streamed, StreamingResponse):
                return streamed
            completion = streamed  # the turn ended before its first text
        else:
            completion = await unless_disconnected(work, receive, session_id)
    except InvalidRequestError as exc:
        raise responses_error(exc) from None
    response = await turn.finish(completion, None)
    if body.stream:
        return stream.sse(stream.whole_events(turn.started, response))
    return Response(turn.response_json, media_type="application/json")  # encoded once


def store_for(deps: GatewayDeps) -> ResponseStore:
    """The stored-response store of a gateway's deps (its Redis client and key prefix)."""
    return ResponseStore(deps.sessions.client, deps.sessions.prefix, deps.settings.response_ttl_s)


def deleted(response_id: str) -> dict[str, Any]:
    """OpenAI's answer to `DELETE /v1/responses/{id}`."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def item_list(
    response_id: str,
    stored: StoredResponse,
    order: str = "desc",
    limit: int = 20,
    after: str | None = None,
) -> dict[str, Any]:
    """OpenAI's answer to `GET /v1/responses/{id}/input_items`: the items of the conversation
    the response answered (every input of its `previous_response_id` chain with the replies in
    between, then its own input; not its output), `order` "desc" (OpenAI's default: newest
    first) or "asc", `limit` of them after the item `after`.

    Raises:
        InvalidRequestError: `after` names no item of this response (param `after`).
    """
    items = conversation_items(response_id, stored.conversation[:-1])  # [-1]: its reply
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(
                f"No input item with id '{after}' in response '{response_id}'.", param="after"
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


NOT_BACKGROUND = "Cannot cancel a synchronous response."
"""OpenAI's 400 for `POST /v1/responses/{id}/cancel` on a response not created with
`background: true` (the only kind OpenAI cancels; this gateway serves no other)."""


def install(app: FastAPI, deps: GatewayDeps) -> None:
    """Add `POST /v1/responses`, `GET` and `DELETE /v1/responses/{response_id}`, `GET
    /v1/responses/{response_id}/input_items`, `POST /v1/responses/{response_id}/cancel` (a 400:
    only background responses are cancelled, and none is served) and their
    `/s/<session_id>/v1/...` forms to the gateway app. A response id the key did not create
    (never stored, `store: false`, expired, deleted, another key's) is a 404
    `not_found_error` in OpenAI's error JSON."""
    store = store_for(deps)

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def retrieve_response(response_id: str, request: Request) -> Response:
        stored = await store.get(response_id, owner_of(request), param=None)
        if stored.response is None:  # stored by a gateway before retrieval was served
            raise NotFoundError(f"Response with id '{response_id}' not found.")
        return Response(dumps(stored.response), media_type="application/json")

    @app.delete("/v1/responses/{response_id}", response_model=None)
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        await store.delete(response_id, owner_of(request))
        return deleted(response_id)

    @app.get("/v1/responses/{response_id}/input_items", response_model=None)
    async def list_input_items(
        response_id: str,
        request: Request,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
        include: Annotated[list[str] | None, Query()] = None,  # nothing to add to text items
    ) -> Response:
        stored = await store.get(response_id, owner_of(request), param=None)
        listed = item_list(response_id, stored, order, limit, after)
        return Response(dumps(listed), media_type="application/json")

    @app.post("/v1/responses/{response_id}/cancel", response_model=None)
    async def cancel_response(response_id: str, request: Request) -> Response:
        await store.get(response_id, owner_of(request), param=None)  # 404 for an unknown id
        raise InvalidRequestError(NOT_BACKGROUND)

    @app.get("/s/{session_id}/v1/responses/{response_id}/input_items", response_model=None)
    async def session_list_input_items(
        session_id: str,
        response_id: str,
        request: Request,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> Response:
        return await list_input_items(response_id, request, order, limit, after, include)

    @app.post("/s/{session_id}/v1/responses/{response_id}/cancel", response_model=None)
    async def session_cancel_response(
        session_id: str, response_id: str, request: Request
    ) -> Response:
        return await cancel_response(response_id, request)

    @app.get("/s/{session_id}/v1/responses/{response_id}", response_model=None)
    async def session_retrieve_response(
        session_id: str, response_id: str, request: Request
    ) -> Response:
        return await retrieve_response(response_id, request)

    @app.delete("/s/{session_id}/v1/responses/{response_id}", response_model=None)
    async def session_delete_response(
        session_id: str, response_id: str, request: Request
    ) -> dict[str, Any]:
        return await delete_response(response_id, request)

    @app.post("/v1/responses", response_model=None)
    async def create_response(
        body: ResponsesRequest,
        request: Request,
        d: Deps,
        x_session_id: SessionHeader = None,
        x_turn_type: TurnHeader = None,
    ) -> Response:
        owner = owner_of(request)
        return await respond(
            d, store, body, owner, request.receive, None, x_session_id, x_turn_type
        )

    @app.post("/s/{session_id}/v1/responses", response_model=None)
    async def session_response(
        session_id: str,
        body: ResponsesRequest,
        request: Request,
        d: Deps,
        x_turn_type: TurnHeader = None,
    ) -> Response:
        owner = owner_of(request)
        return await respond(d, store, body, owner, request.receive, session_id, None, x_turn_type)
