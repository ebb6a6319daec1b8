"""Cancelling the demo's in-flight episodes once it is stopping (Ctrl-C, SIGTERM).

Every HTTP client of an episode (the driver's session requests, the agents' OpenAI clients)
checks the runner's `stopping` event before each request and raises `EpisodeCancelled` once it
is set: the `openai` client passes an `OpenAIError` on without retrying, so an episode whose
stack is being stopped ends at its next request, quietly, instead of retrying against a gateway
that is gone and logging each failure as the server's."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import openai


class EpisodeCancelled(openai.OpenAIError):
    """An episode's request refused because the demo is stopping."""


def request_check(stopping: threading.Event) -> Callable[[Any], None]:
    """An httpx request hook raising `EpisodeCancelled` once `stopping` is set."""

    def check(_request: Any) -> None:
        if stopping.is_set():
            raise EpisodeCancelled("the demo is stopping: episode cancelled")

    return check


def async_request_check(stopping: threading.Event) -> Callable[[Any], Awaitable[None]]:
    """`request_check` for an async httpx client."""
    check = request_check(stopping)

    async def acheck(request: Any) -> None:
        check(request)

    return acheck


def openai_http_client(stopping: threading.Event | None) -> Any:
    """The http client of an agent's `OpenAI` client: cancelled by `stopping` (None: the SDK's
    own default)."""
    if stopping is None:
        return None
    return openai.DefaultHttpxClient(event_hooks={"request": [request_check(stopping)]})


def openai_async_http_client(stopping: threading.Event | None) -> Any:
    """`openai_http_client` for an `AsyncOpenAI` client."""
    if stopping is None:
        return None
    return openai.DefaultAsyncHttpxClient(event_hooks={"request": [async_request_check(stopping)]})
