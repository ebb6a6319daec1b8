"""SGLang's distributed weight-update routes (docs/engine-protocol.md).

`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`, `/begin_weight_update`, `/end_weight_update`. Bodies are
SGLang's request structs (unknown keys ignored, a JSON body required); every answer is
`{"success", "message"}`, 200 on success and 400 on failure. The blocking work (rendezvous,
receiving broadcasts) runs in a thread, so the event loop keeps serving /generate meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from flywheel.engine.protocol import dumps

DEFAULT_GROUP = "weight_update_group"


class InitGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class UpdateFromDistributedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group_name: str = DEFAULT_GROUP


class BeginRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    selector: str = "all"


def _answer(ok: bool, message: str) -> Response:
    return Response(
        dumps({"success": ok, "message": message}),
        status_code=200 if ok else 400,
        media_type="application/json",
    )


def register_weight_routes(
    app: FastAPI,
    body: Callable[[Request], Awaitable[dict[str, Any]]],
    parse: Callable[[type[Any], dict[str, Any]], Any],
) -> None:
    """Add the routes; `body` reads a required JSON object, `parse` validates it (400s)."""
    from flywheel.engine.app import get_deps

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> Response:
        req: InitGroupRequest = parse(InitGroupRequest, await body(request))
        weights = get_deps(request).engine.weights
        ok, msg = await asyncio.to_thread(
            weights.init_group,
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
        )
        return _answer(ok, msg)

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> Response:
        req: UpdateFromDistributedRequest = parse(UpdateFromDistributedRequest, await body(request))
        if req.load_format not in (None, "direct"):
            return _answer(False, f"load_format {req.load_format!r} is not supported")
        weights = get_deps(request).engine.weights
        ok, msg = await asyncio.to_thread(
            lambda: weights.from_distributed(
                req.names,
                req.dtypes,
                req.shapes,
                req.group_name,
                weight_version=req.weight_version,
                abort_all_requests=req.abort_all_requests,
            )
        )
        return _answer(ok, msg)

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> Response:
        req: DestroyGroupRequest = parse(DestroyGroupRequest, await body(request))
        weights = get_deps(request).engine.weights
        return _answer(*await asyncio.to_thread(weights.destroy_group, req.group_name))

    @app.post("/begin_weight_update")
    async def begin(request: Request) -> Response:
        req: BeginRequest = parse(BeginRequest, await body(request))
        return _answer(*get_deps(request).engine.weights.begin(req.selector))

    @app.post("/end_weight_update")
    async def end(request: Request) -> Response:
        await body(request)
        return _answer(*get_deps(request).engine.weights.end())
