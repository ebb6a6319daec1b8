"""The gateway's shared dependencies: what every route and turn module is given.

`create_app(deps)` (app.py) builds the app from a `GatewayDeps` (house style C8): tests swap in
fakes; `main.py` builds the real ones. Route modules take the deps from here (`Deps`, a FastAPI
dependency), never from app.py, so nothing imports the app module back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, Header, Request

from flywheel.core.retention import StreamRetention
from flywheel.core.settings import GatewaySettings
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore


class Engines(Protocol):
    """What the gateway asks of its engines (engines/pool.py `EnginePool`, or a test fake)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        affinity: str = "",
        top_logprobs_num: int = 0,
    ) -> Generation: ...


class Publisher(Protocol):
    """The Sample stream and its backpressure rule (core.streams.StreamProducer): sessions add
    their Samples to `stream` when they save (SessionRecord.queue)."""

    async def abacklog(self) -> int: ...

    stream: str
    high_water: int
    watch_group: str


@dataclass
class GatewayDeps:
    """Everything a request needs: settings, the chat renderer, engines, session store and the
    Sample stream."""

    settings: GatewaySettings
    renderer: ChatRenderer
    engines: Engines
    sessions: SessionStore
    publisher: Publisher
    context_length: int = 2048
    """Tokens (prompt + completion) the engine serves per request."""
    retention: StreamRetention | None = None
    """The pipeline's streams and `streams.retention`, trimmed by the gateway's retention task
    (core/retention.py); None = no task (tests, embedded apps)."""
    fleet: Any = None
    """The engine fleet watch (engines/fleet_watch.py `FleetWatch`), refreshed by a background
    task; None = the engines stay as given (tests, embedded apps)."""

    def with_engines(self, engines: Engines) -> GatewayDeps:
        """These deps with other `engines` (every other field the same objects): a shallow
        copy that, unlike `dataclasses.replace`, runs no `__init__` (per request on the
        Messages route)."""
        new = object.__new__(GatewayDeps)
        new.__dict__.update(self.__dict__)
        new.engines = engines
        return new


async def get_deps(request: Request) -> GatewayDeps:
    """The app's dependencies (async: FastAPI runs a sync dependency in a worker thread)."""
    return request.app.state.deps


Deps = Annotated[GatewayDeps, Depends(get_deps)]
# Documented shapes only: the handlers check both headers themselves, with their own messages.
SessionHeader = Annotated[
    str | None,
    Header(
        description="Session id (live mode; created on first use)",
        json_schema_extra={"pattern": "^[A-Za-z0-9_.:-]{1,128}$"},
    ),
]
TurnHeader = Annotated[
    str | None,
    Header(
        description="main (recorded, default) | side (served, not recorded)",
        json_schema_extra={"enum": ["main", "side"]},
    ),
]
