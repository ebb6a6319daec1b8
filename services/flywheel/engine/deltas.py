"""`POST /update_weights_from_delta`: apply a weight delta (format: flywheel.core.weight_delta).

Body `{"delta_path", "base_version", "weight_version", "abort_all_requests": false,
"flush_cache": true}`. The engine applies the delta only when

1. it serves exactly `base_version` (its `weight_version` label) and the file's metadata says
   the same base and target versions (else reason `base_mismatch`);
2. the file fits the model: known names, the served dtype, shapes, indices in range, and its
   digests name every tensor of the served model (else `invalid`);
3. the xxh3-128 of every result tensor (changed ones after applying, unchanged ones as served)
   equals the digest the trainer recorded (else `checksum_mismatch`).

Then the changed tensors are swapped in like a disk update (between two decode steps,
`engine.weight_swap`) and the label becomes `weight_version`: 200 `{"success": true, "message",
"changed_tensors", "changed_elements"}`. A refusal changes nothing and answers 400 `{"success":
false, "message", "reason"}`; the trainer then pushes the full weights. Every outcome is counted
in `flywheel_engine_weight_deltas_total{outcome}` (`applied` or the reason) and a refusal is
logged. SGLang has no such route, so a trainer gets 404 from a real SGLang server and pushes
full weights to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from safetensors import SafetensorError, safe_open
from torch import Tensor

from flywheel.core.weight_delta import (
    CHECKSUM,
    DELTA_FILE,
    FORMAT,
    FULL,
    GAP,
    ROUTE,
    VAL,
    ZSPARSE,
    DeltaUpdateRequest,
    digest,
    split_key,
)
from flywheel.engine.protocol import dumps

if TYPE_CHECKING:
    from flywheel.engine.worker import EngineWorker

log = logging.getLogger(__name__)


class DeltaRefused(Exception):
    """The delta was not applied; `reason` is one of weight_delta.REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def _tensor_digest(tensor: Tensor) -> str:
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    return digest(flat.view(torch.uint8).numpy())


def _read(path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, entries) of a delta file or of the folder holding one.

    Raises:
        DeltaRefused: missing or unreadable file (invalid).
    """
    file = path / DELTA_FILE if path.is_dir() else path
    if not file.is_file():
        raise DeltaRefused("invalid", f"{path} holds no {DELTA_FILE}")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = dict(f.metadata() or {})
            entries = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as e:
        raise DeltaRefused("invalid", f"cannot read {file}: {e}") from e
    return meta, entries


def _unique_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's state dict without later names of shared storage (a tied lm_head)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor
    return out


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _indices(name: str, gap: Tensor, numel: int) -> Tensor:
    """Flat indices (int64) from uint8 gaps (the first counted from -1).

    Raises:
        DeltaRefused: a gap is 0 or an index is >= numel (invalid).
    """
    idx = torch.cumsum(gap.long(), 0) - 1
    if gap.numel() and (int(gap.min()) == 0 or int(idx[-1]) >= numel):
        raise DeltaRefused("invalid", f"{name}: a gap is 0 or an index is outside 0..{numel - 1}")
    return idx


def inflate_sparse(name: str, blob: Tensor, live: Tensor) -> tuple[Tensor, Tensor]:
    """(flat indices, XOR bit patterns of those elements) from a `:zsparse` entry of the
    served tensor `live` (format: flywheel.core.weight_delta).

    Example (bf16, 2 B elements): a stream inflating to 6 bytes = 2 entries x (1 + 2):
    gaps 01 03 -> indices 0, 3; planes 01 01 00 00 -> XORs 0x0001, 0x0001.

    Raises:
        DeltaRefused: not a 1-D uint8 entry, not a zlib stream, or one that inflates to more
            than numel x (1 + element bytes) or to a length that is no whole number of
            entries (invalid).
    """
    size = live.element_size()
    limit = live.numel() * (1 + size)
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise DeltaRefused("invalid", f"{name}: {ZSPARSE} must be 1-D uint8")
    stream = zlib.decompressobj()
    try:
        data = stream.decompress(blob.numpy().tobytes(), limit + 1)
    except zlib.error as e:
        raise DeltaRefused("invalid", f"{name}: {ZSPARSE} is no zlib stream: {e}") from e
    count, rest = divmod(len(data), 1 + size)
    if len(data) > limit or not stream.eof or stream.unused_data or rest or count == 0:
        raise DeltaRefused(
            "invalid",
            f"{name}: {ZSPARSE} inflates to {len(data)}{'+' if not stream.eof else ''} bytes, "
            f"not n x {1 + size} with n in 1..{live.numel()}",
        )
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    idx = _indices(name, raw[:count], live.numel())
    xor = torch.empty(count, dtype=_INTS[size])
    xor.view(torch.uint8).view(count, size).copy_(raw[count:].view(size, count).t())
    return idx, xor


def build_result(
    served: dict[str, Tensor], entries: dict[str, Tensor]
) -> tuple[dict[str, Tensor], int]:
    """The new values of the changed tensors (CPU copies; `served` is not touched) and the
    number of changed elements (fillers of sparse entries included).

    Raises:
        DeltaRefused: unknown name, wrong dtype or shape, unpaired gap/val, a zero gap, an
            index out of range, an unreadable compressed entry (invalid).
    """
    parts: dict[str, dict[str, Tensor]] = {}
    for key, tensor in entries.items():
        try:
            name, suffix = split_key(key)
        except ValueError as e:
            raise DeltaRefused("invalid", str(e)) from e
        parts.setdefault(name, {})[suffix] = tensor
    result: dict[str, Tensor] = {}
    changed = 0
    for name, part in parts.items():
        if name not in served:
            raise DeltaRefused("invalid", f"the model has no tensor {name!r}")
        live = served[name]
        if FULL in part:
            new = part[FULL]
            if set(part) != {FULL} or new.shape != live.shape or new.dtype != live.dtype:
                raise DeltaRefused(
                    "invalid",
                    f"{name}: full entry {new.dtype}{list(new.shape)} does not replace the "
                    f"served {live.dtype}{list(live.shape)}",
                )
            result[name] = new
            changed += new.numel()
            continue
        new = live.detach().to("cpu", copy=True).contiguous()
        if ZSPARSE in part:
            if set(part) != {ZSPARSE}:
                raise DeltaRefused("invalid", f"{name}: {ZSPARSE} comes alone")
            idx, xor = inflate_sparse(name, part[ZSPARSE], live)
            bits = new.view(-1).view(_INTS[new.element_size()])
            bits[idx] ^= xor
            result[name] = new
            changed += idx.numel()
            continue
        if set(part) != {GAP, VAL}:
            raise DeltaRefused("invalid", f"{name}: needs both {GAP} and {VAL} entries")
        gap, val = part[GAP], part[VAL]
        if gap.dtype != torch.uint8 or gap.dim() != 1 or gap.shape != val.shape:
            raise DeltaRefused("invalid", f"{name}: {GAP} must be 1-D uint8 shaped like {VAL}")
        if val.dtype != live.dtype:
            raise DeltaRefused(
                "invalid", f"{name}: delta values are {val.dtype}, the engine serves {live.dtype}"
            )
        idx = _indices(name, gap, live.numel())
        new.view(-1)[idx] = val
        result[name] = new
        changed += idx.numel()
    return result, changed


def check_digests(
    served: dict[str, Tensor], result: dict[str, Tensor], expected: dict[str, str]
) -> None:
    """Every tensor of the model after the update has the trainer's digest.

    Raises:
        DeltaRefused: a served tensor has no digest (invalid), or a digest differs
            (checksum_mismatch, naming up to 5 tensors).
    """
    missing = sorted(set(served) - set(expected))
    unknown = sorted(set(expected) - set(served))
    if missing or unknown:
        raise DeltaRefused(
            "invalid",
            f"the delta's digests do not cover the model: missing {missing[:5]}, unknown "
            f"{unknown[:5]}",
        )
    wrong = [
        name
        for name, tensor in served.items()
        if _tensor_digest(result.get(name, tensor)) != expected[name]
    ]
    if wrong:
        raise DeltaRefused(
            "checksum_mismatch",
            f"{len(wrong)} tensors differ from the trainer's after applying the delta: {wrong[:5]}",
        )


def apply_delta(worker: EngineWorker, req: DeltaUpdateRequest) -> tuple[int, int]:
    """Check and apply one delta (module docstring); returns (changed tensors, elements).

    Raises:
        DeltaRefused: the delta was not applied (nothing changed).
    """
    runner = worker.runner
    if worker.status != "ready" or runner is None:
        raise DeltaRefused("error", f"the engine is {worker.status}")
    updater = worker.weights
    with updater._lock:  # the updater's lock: one weight update at a time
        if worker.weight_version != req.base_version:
            raise DeltaRefused(
                "base_mismatch",
                f"the engine serves weight version {worker.weight_version!r}, the delta "
                f"applies to {req.base_version!r}",
            )
        meta, entries = _read(Path(req.delta_path))
        if meta.get("format") != FORMAT or meta.get("checksum") != CHECKSUM:
            raise DeltaRefused(
                "invalid",
                f"format {meta.get('format')!r}/{meta.get('checksum')!r} is not "
                f"{FORMAT}/{CHECKSUM}",
            )
        if (meta.get("base_version"), meta.get("weight_version")) != (
            req.base_version,
            req.weight_version,
        ):
            raise DeltaRefused(
                "base_mismatch",
                f"the file turns {meta.get('base_version')!r} into "
                f"{meta.get('weight_version')!r}, the request says {req.base_version!r} -> "
                f"{req.weight_version!r}",
            )
        try:
            expected = json.loads(meta.get("checksums", ""))
        except json.JSONDecodeError as e:
            raise DeltaRefused("invalid", f"unreadable checksums: {e}") from e
        served = _unique_state(runner.model)
        result, changed = build_result(served, entries)
        check_digests(served, result, expected)
        updater._swap(result, req.weight_version, req.abort_all_requests)
    return len(result), changed


def register_delta_routes(
    app: FastAPI,
    body: Callable[[Request], Awaitable[dict[str, Any]]],
    parse: Callable[[type[Any], dict[str, Any]], Any],
) -> None:
    """Add `POST /update_weights_from_delta`; `body` reads the JSON object, `parse` validates."""
    from flywheel.engine.app import get_deps  # noqa: PLC0415

    @app.post(ROUTE)
    async def update_weights_from_delta(request: Request) -> Response:
        req: DeltaUpdateRequest = parse(DeltaUpdateRequest, await body(request))
        engine = cast("EngineWorker", get_deps(request).engine)
        counter = engine.metrics.weight_deltas
        t0 = time.perf_counter()
        try:
            tensors, elements = await asyncio.to_thread(apply_delta, engine, req)
        except DeltaRefused as e:
            counter.labels(e.reason).inc()
            log.warning(
                "weight delta %s -> %s refused (%s): %s",
                req.base_version,
                req.weight_version,
                e.reason,
                e.message,
            )
            answer = {"success": False, "message": e.message, "reason": e.reason}
            return Response(dumps(answer), status_code=400, media_type="application/json")
        counter.labels("applied").inc()
        log.info(
            "weight delta %s -> %s applied in %.2f s: %d tensors, %d elements",
            req.base_version,
            req.weight_version,
            time.perf_counter() - t0,
            tensors,
            elements,
        )
        answer = {
            "success": True,
            "message": "Succeeded to update model weights.",
            "changed_tensors": tensors,
            "changed_elements": elements,
        }
        return Response(dumps(answer), media_type="application/json")
