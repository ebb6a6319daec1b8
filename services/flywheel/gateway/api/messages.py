"""The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens` (and
their `/s/<session id>/` forms), served as one chat turn each (docs/token-path.md).

A Messages request becomes one `ChatCompletionRequest` (messages_convert.py) and is served by
the chat path's `chat.serve`: the same session (`X-Session-Id`, created in live mode on first
use, or the URL's), the same stitching and recording, the same engine call. Its
`chat.completion` becomes the `message` (or its stream events, messages_stream.py). Keys come
from `x-api-key` or `Authorization: Bearer` (access/security.py); `anthropic-version` and
`anthropic-beta` headers are accepted and change nothing; errors are Anthropic's JSON
(messages_errors.py).

`count_tokens` renders the conversation with the chat template exactly as the turn's fresh
prompt would be rendered (system, messages and tools) and answers `{"input_tokens": n}`.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from flywheel.gateway.access.principal import owner_of
from flywheel.gateway.api import chat, messages_convert, messages_stream
from flywheel.gateway.api.disconnect import unless_disconnected
from flywheel.gateway.api.incremental import TextFeed
from flywheel.gateway.api.json_text import dumps
from flywheel.gateway.api.messages_schema import CountTokensRequest, MessagesRequest
from flywheel.gateway.api.request_rules import check_model
from flywheel.gateway.deps import Deps, GatewayDeps, SessionHeader, TurnHeader
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.engines.stops import reconcile_stop
from flywheel.gateway.render.tokenization import render_call, text_size


class EngineProbe:
    """The deps' engines, noting what a turn asked of them: the prompt's length (for
    `message_start`, sent before the turn ends) and the engine's generations (for the stop
    sequence that ended the turn). One per request."""

    def __init__(self, engines: Any):
        self._engines = engines
        self.prompt_tokens = 0
        self.generations: list[Generation] = []

    async def generate(self, input_ids: list[int], *args: Any, **kwargs: Any) -> Generation:
        self.prompt_tokens = len(input_ids)
        gen: Generation = await self._engines.generate(input_ids, *args, **kwargs)
        self.generations.append(gen)
        return gen

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engines, name)  # AttributeError when the engines lack it
        if name != "generate_stream":
            return attr

        async def generate_stream(input_ids: list[int], *args: Any, **kwargs: Any) -> Generation:
            self.prompt_tokens = len(input_ids)
            gen: Generation = await attr(input_ids, *args, **kwargs)
            self.generations.append(gen)
            return gen

        return generate_stream


def matched_stop(d: GatewayDeps, probe: EngineProbe, stops: list[str]) -> str | None:
    """The stop sequence that ended the turn's generation, or None (an EOS, the token cap, no
    stop sequences): the engine's answer cut at its first stop exactly as the turn cut it
    (`reconcile_stop`)."""
    if not stops or len(probe.generations) != 1:
        return None
    eos = d.renderer.eos_token_id
    gen = reconcile_stop(
        probe.generations[0], d.renderer.decode, stops, () if eos is None else (eos,)
    )
    return gen.matched if isinstance(gen.matched, str) and gen.matched in stops else None


async def create_message(
    d: GatewayDeps,
    body: MessagesRequest,
    session_id: str | None,
    header_id: str | None,
    turn_type: str | None,
    owner: str,
    receive: Any,
) -> Response:
    """One Messages request end to end (see the module docstring): the `message` as JSON, or
    its events (`stream`).

    Raises:
        PlatformError: as `chat.respond`, `messages_convert.chat_request` and
            `messages_convert.check_tool_results`.
    """
    turn = messages_convert.chat_request(body)
    messages_convert.check_tool_results(turn)
    chat.check_chat(d, turn)
    create_owner = None
    if session_id is None:
        session_id = chat.session_header(header_id)
        create_owner = None if session_id is None else owner
    stops = body.stop_sequences or []
    probe = EngineProbe(d.engines)
    # The probe's notes serve the stream's `message_start` and a stop sequence's
    # `stop_sequence`; a whole reply without stop sequences needs neither.
    served = d.with_engines(probe) if body.stream or stops else d
    work = chat.serve(served, turn, session_id, turn_type, create_owner=create_owner)
    if not body.stream:  # the message's id: "msg_" + the completion's 32 random hex digits
        completion = await unless_disconnected(work, receive, session_id)
        out = messages_convert.message(completion, matched_stop(d, probe, stops))
        return Response(dumps(out), media_type="application/json")
    msg_id = f"msg_{uuid.uuid4().hex}"  # sent in `message_start`, before the completion

    def finish(completion: dict[str, Any]) -> dict[str, Any]:
        out = messages_convert.message(completion, matched_stop(d, probe, stops))
        out["id"] = msg_id
        return out

    model = body.model

    def head() -> str:
        return messages_stream.message_start(msg_id, model, probe.prompt_tokens)

    feed = TextFeed(stops, turn.tools_offered)
    streamed = await messages_stream.respond(work, receive, session_id, feed, head, finish)
    if isinstance(streamed, StreamingResponse):
        return streamed
    return StreamingResponse(messages_stream.whole_events(streamed), media_type="text/event-stream")


async def count_tokens(d: GatewayDeps, body: CountTokensRequest) -> dict[str, int]:
    """`{"input_tokens": n}`: the length of the fresh prompt the turn would render.

    Raises:
        InvalidRequestError: as `messages_convert.chat_request` and `check_tool_results`, or
            the template refuses it.
        ModelNotFoundError: a model this gateway does not serve.
    """
    check_model(d.settings, body.model)
    turn = messages_convert.chat_request(body, sampling=False)
    messages_convert.check_tool_results(turn)
    messages = [m.for_template() for m in turn.messages]
    ids = await render_call(
        text_size(messages, turn.tools), d.renderer.prompt_ids, messages, turn.tools
    )
    return {"input_tokens": len(ids)}


async def messages(
    body: MessagesRequest,
    request: Request,
    d: Deps,
    x_session_id: SessionHeader = None,
    x_turn_type: TurnHeader = None,
) -> Response:
    return await create_message(
        d, body, None, x_session_id, x_turn_type, owner_of(request), request.receive
    )


async def session_messages(
    session_id: str,
    body: MessagesRequest,
    request: Request,
    d: Deps,
    x_turn_type: TurnHeader = None,
) -> Response:
    return await create_message(d, body, session_id, None, x_turn_type, "", request.receive)


async def messages_count_tokens(body: CountTokensRequest, d: Deps) -> dict[str, int]:
    return await count_tokens(d, body)


async def session_messages_count_tokens(
    session_id: str, body: CountTokensRequest, d: Deps
) -> dict[str, int]:
    return await count_tokens(d, body)


def install(app: FastAPI) -> None:
    """Add the Messages routes to the gateway app (`/v1/messages`, `/v1/messages/count_tokens`
    and their `/s/{session_id}/` forms)."""
    app.post("/v1/messages", response_model=None)(messages)
    app.post("/s/{session_id}/v1/messages", response_model=None)(session_messages)
    app.post("/v1/messages/count_tokens")(messages_count_tokens)
    app.post("/s/{session_id}/v1/messages/count_tokens")(session_messages_count_tokens)
