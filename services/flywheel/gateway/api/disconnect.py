"""Stop a request whose client has gone.

An agent harness that times out (the openai SDK's `timeout`) or is cancelled closes its
connection and usually sends the same request again. Had the gateway finished the abandoned
turn, it would have recorded and published a reply nobody received (and, in a session, the
retry would become a second branch of the same turn). Instead the turn is cancelled as soon as
the server reports the disconnect: the engine call is dropped (SGLang aborts a request whose
connection closes), the session lock is released without saving, nothing is published.

A client that disconnects while the turn is being saved or its answer written finds it recorded
(the save, one Redis round trip, always runs to its end: `locks.locked`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from prometheus_client import Counter
from starlette.types import Receive

from flywheel.core.errors import ClientClosedError

log = logging.getLogger(__name__)

T = TypeVar("T")

ABANDONED = Counter(
    "flywheel_gateway_requests_abandoned_total",
    "Requests stopped because the client closed the connection before the "
    "answer was ready (nothing of them recorded or published)",
    ["kind"],
)


async def until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    work: Coroutine[Any, Any, T], receive: Receive | None, session_id: str | None
) -> T:
    """`await work`, cancelled when the ASGI `receive` (the request body already read) reports
    `http.disconnect` first.

    Args:
        work: the request's turn (engine call, session lock, recording).
        receive: the server's receive after the body; None: just await `work`.
        session_id: the session the request is recorded in (None: unrecorded), for the
            metric's `kind` and the log line.

    Raises:
        ClientClosedError: the client disconnected; `work` was cancelled and has finished
            unwinding (its session lock released, nothing saved).
    """
    if receive is None:
        return await work
    turn = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait((turn, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request itself was cancelled (e.g. its time limit)
        turn.cancel()
        watcher.cancel()
        raise
    if turn.done():
        watcher.cancel()
        return turn.result()
    await stop_abandoned(turn, session_id)
    raise ClientClosedError("the client closed the connection before the answer was ready")


async def stop_abandoned(turn: asyncio.Future[Any], session_id: str | None) -> None:
    """Cancel the turn of a request whose client has gone and wait until it has unwound (its
    session lock released, nothing saved); counted in `ABANDONED` and logged."""
    what = "unrecorded" if session_id is None else f"session {session_id}"
    turn.cancel()
    try:
        await turn
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # noqa: BLE001  (the turn failed while unwinding; logged)
        log.warning("%s: the abandoned request failed while stopping: %r", what, exc)
    ABANDONED.labels("unrecorded" if session_id is None else "session").inc()
    log.warning(
        "%s: the client closed the connection before the answer was ready; the "
        "request was stopped before it was recorded",
        what,
    )
