"""Delta pushes: send an engine only the elements that changed since the version it serves.

`trainer.push.delta = true` (disk pushes): `DeltaWeightsStore.write` keeps the CPU snapshot of
the last version it wrote (the base, in the engine's dtype) and writes the next version's folder
`weights/v_<version>/` with `delta.safetensors` (format: flywheel.core.weight_delta) instead of
the full `model.safetensors`. `DeltaPushes.push` (called by `WeightPusher` for each engine)
posts `/update_weights_from_delta` with the base version; the engine applies it only when it
serves that base and every result tensor's xxh3-128 equals the trainer's. Any refusal (the engine
serves another version, a digest differs, the file does not fit, an engine without the route such
as SGLang) is counted in `flywheel_trainer_weight_delta_fallbacks_total{reason}`, logged, and
that engine gets the full weights by `/update_weights_from_disk` (`model.safetensors` is written
into the folder then, once, from the held snapshot). The first push of a trainer process has no
base and is full.

In bf16 about 1-3% of the elements change per step and each changed tensor is stored as the
cheapest of its sparse, zlib-compressed or whole encodings; in fp32 nearly every element
changes, every tensor is stored whole and the delta is as large as the full weights
(bench/README.md, "Delta pushes").
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from prometheus_client import Counter
from safetensors.torch import save_file

from flywheel.core.errors import ConfigurationError, UpstreamError
from flywheel.core.weight_delta import (
    DELTA_FILE,
    FULL,
    GAP,
    MAX_GAP,
    ROUTE,
    VAL,
    ZLIB_LEVEL,
    ZSPARSE,
    cheapest,
    digest,
    metadata,
)
from flywheel.trainer.weights import _NOT_COPIED, WEIGHTS_FILE, WeightsStore, unique_storage

log = logging.getLogger(__name__)

DELTA_FALLBACKS = Counter(
    "flywheel_trainer_weight_delta_fallbacks_total",
    "Engines that got a full weight push instead of a delta, by reason",
    ["reason"],
)
PUSH_BYTES = Counter(
    "flywheel_trainer_weight_push_bytes_total",
    "Bytes of weight files written for pushes, by kind (delta or full)",
    ["kind"],
)
DELTAS_APPLIED = Counter(
    "flywheel_trainer_weight_deltas_applied_total", "Delta pushes an engine applied"
)


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes in C order (any dtype; copied to the CPU first)."""
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    return digest(flat.view(torch.uint8).numpy())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers (flat), for bitwise comparison."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(-1).view(ints[tensor.element_size()])


def with_fillers(idx: torch.Tensor) -> torch.Tensor:
    """Ascending flat indices (int64) with filler indices added wherever two successive ones
    (the first counted from -1) are more than 255 apart, so every gap fits a uint8.

    Example: [600] -> [254, 509, 600] (gaps from -1: 255, 255, 91); [3, 259] -> [3, 258, 259]
    (gaps 4, 255, 1: 259 - 3 = 256 does not fit).
    """
    prev = torch.cat([idx.new_tensor([-1]), idx[:-1]])
    fill = (idx - prev - 1) // MAX_GAP
    if not bool(fill.any()):
        return idx
    starts = torch.repeat_interleave(prev, fill)
    rank = torch.arange(int(fill.sum())) - torch.repeat_interleave(
        torch.cumsum(fill, 0) - fill, fill
    )
    return torch.sort(torch.cat([idx, starts + MAX_GAP * (rank + 1)])).values


def byte_planes(bits: torch.Tensor) -> bytes:
    """The bytes of a 1-D integer tensor grouped by byte position: byte 0 (the lowest, the
    elements being little-endian) of every element, then byte 1, and so on.

    Example: int16 [0x0102, 0x0304] (bytes 02 01 04 03) -> 02 04 01 03.
    """
    size = bits.element_size()
    return bits.contiguous().view(torch.uint8).view(-1, size).t().contiguous().numpy().tobytes()


def compress_sparse(gaps: torch.Tensor, xor: torch.Tensor, level: int = ZLIB_LEVEL) -> bytes:
    """The `:zsparse` stream: zlib of the uint8 gaps followed by `byte_planes(xor)` (the XOR of
    the old and new bits of the same elements; format in flywheel.core.weight_delta)."""
    return zlib.compress(gaps.numpy().tobytes() + byte_planes(xor), level)


@dataclass
class DeltaStats:
    """What one delta holds."""

    tensors: int
    changed_tensors: int
    full_tensors: int
    """Changed tensors stored whole (`:full`) because that is smaller."""
    elements: int
    changed_elements: int
    compressed_tensors: int = 0
    """Changed tensors stored as `:zsparse` (the others are `:gap` + `:val`)."""


def encode_delta(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], level: int = ZLIB_LEVEL
) -> tuple[dict[str, torch.Tensor], DeltaStats]:
    """The delta file's tensors turning `base` into `new` (same names, shapes and dtypes), each
    changed tensor in the cheapest encoding (`weight_delta.cheapest`).

    Args:
        base, new: name -> CPU tensor (tied aliases already removed).
        level: zlib level of the compressed entries (1-9).

    Returns:
        (entries `<name>:gap`/`<name>:val`, `<name>:zsparse` or `<name>:full`, stats).

    Raises:
        ValueError: the names, a shape or a dtype differ (the caller writes a full push).
    """
    if base.keys() != new.keys():
        raise ValueError("the tensor names changed")
    entries: dict[str, torch.Tensor] = {}
    stats = DeltaStats(len(new), 0, 0, 0, 0)
    for name, tensor in new.items():
        old = base[name]
        if old.shape != tensor.shape or old.dtype != tensor.dtype:
            raise ValueError(f"{name} changed shape or dtype")
        numel = tensor.numel()
        stats.elements += numel
        xor = _bits(tensor) ^ _bits(old)
        idx = xor.nonzero().view(-1)
        if idx.numel() == 0:
            continue
        stats.changed_tensors += 1
        stats.changed_elements += idx.numel()
        idx = with_fillers(idx)
        size = tensor.element_size()
        prev = torch.cat([idx.new_tensor([-1]), idx[:-1]])
        gaps = (idx - prev).to(torch.uint8)
        packed = compress_sparse(gaps, xor[idx], level)
        kind = cheapest(idx.numel(), numel, size, len(packed))
        if kind == "compressed":
            entries[name + ZSPARSE] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            stats.compressed_tensors += 1
        elif kind == "sparse":
            entries[name + GAP] = gaps
            entries[name + VAL] = tensor.contiguous().view(-1)[idx]
        else:
            entries[name + FULL] = tensor.contiguous()
            stats.full_tensors += 1
    return entries, stats


@dataclass
class _Held:
    version: int
    state: dict[str, torch.Tensor]
    """Unique-storage CPU snapshot (engine dtype)."""
    checksums: dict[str, str]
    folder: Path


class DeltaWeightsStore:
    """`WeightsStore.write` with deltas against the last written version (module docstring).

    Args:
        store: the full-weights store whose folders this writes into.

    Memory: one extra CPU copy of the weights in the push dtype (the held base).
    """

    def __init__(self, store: WeightsStore):
        self.store = store
        self._held: _Held | None = None
        self._lock = threading.Lock()
        self.last_stats: DeltaStats | None = None
        """Stats of the newest delta written (None after a full write)."""

    @property
    def base_version(self) -> int | None:
        """The version a delta written now would start from (the last one written)."""
        held = self._held
        return None if held is None else held.version

    def write(self, version: int, state: dict[str, torch.Tensor]) -> Path:
        """Write `state` (a CPU snapshot) as `version`: a delta against the last version
        written when there is one and it fits, else the full weights. Returns the folder.

        Raises:
            OSError: the disk refused the write.
        """
        state = unique_storage(state)
        checksums = {name: tensor_digest(t) for name, t in state.items()}
        with self._lock:
            held, self._held = self._held, None
        entries: dict[str, torch.Tensor] | None = None
        if held is not None and held.version < version:
            try:
                entries, self.last_stats = encode_delta(held.state, state)
            except ValueError as exc:
                log.warning("weight version %d is pushed full: %s", version, exc)
        if entries is None:
            self.last_stats = None
            folder = self.store.write(version, state)
            PUSH_BYTES.labels("full").inc((folder / WEIGHTS_FILE).stat().st_size)
        else:
            assert held is not None
            folder = self._write_delta(version, held.version, entries, checksums)
        with self._lock:
            self._held = _Held(version, state, checksums, folder)
        return folder

    def _write_delta(
        self, version: int, base: int, entries: dict[str, torch.Tensor], checksums: dict[str, str]
    ) -> Path:
        """The folder of `version` with delta.safetensors only (atomic: a temporary sibling,
        then rename; pruned like full folders). The config and tokenizer files an engine needs
        to load a folder come with the full weights (`full_folder`)."""
        final = self.store.root / f"v_{version:08d}"
        tmp = self.store.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(entries, str(tmp / DELTA_FILE), metadata=metadata(base, version, checksums))
        if final.exists():  # a version trained again after a crash
            shutil.rmtree(final)
        tmp.rename(final)
        self.store.prune(written=version)
        PUSH_BYTES.labels("delta").inc((final / DELTA_FILE).stat().st_size)
        return final

    def full_folder(self, folder: Path, version: int) -> Path:
        """`folder` with `model.safetensors` (and the config and tokenizer files) in it, written
        now from the held snapshot when only the delta was written (the weights atomically: a
        temporary file, then rename, last).

        Raises:
            UpstreamError: the folder has no full weights and `version` is not the snapshot
                held any more (a newer version was written since); that engine is behind
                and gets the next version.
        """
        target = Path(folder) / WEIGHTS_FILE
        with self._lock:
            if target.is_file():
                return Path(folder)
            held = self._held
            if held is None or held.version != version or held.folder != Path(folder):
                raise UpstreamError(
                    f"{folder} holds a delta only and weight version {version} is no longer "
                    "held; the engine gets the next version in full"
                )
            source = self.store.source_dir
            for src in source.iterdir() if source.is_dir() else []:
                if src.is_file() and not _NOT_COPIED.search(src.name):
                    shutil.copy2(src, Path(folder) / src.name)
            tmp = target.with_name(f".{WEIGHTS_FILE}.tmp-{os.getpid()}")
            save_file(held.state, str(tmp), metadata={"format": "pt"})
            tmp.rename(target)  # last: a folder with model.safetensors is complete
        PUSH_BYTES.labels("full").inc(target.stat().st_size)
        return Path(folder)


class DeltaPushes:
    """The engine side of delta pushes, per engine: try the delta, else say why not.

    Args:
        store: the writer of the folders (its held base version is the delta's base).
    """

    def __init__(self, store: DeltaWeightsStore):
        self.store = store
        self.unsupported: set[str] = set()
        """Engines without the delta route (real SGLang): full pushes only."""

    def push(
        self, client: httpx.Client, url: str, folder: Path, version: int, timeout_s: float
    ) -> bool:
        """Post the delta in `folder` to `url`; True when the engine applied it. False
        (counted, logged) when the folder has no delta or the engine refused it: the caller
        pushes the full weights (`full_folder`)."""
        delta = Path(folder) / DELTA_FILE
        if not delta.is_file():
            return False
        if url in self.unsupported:
            DELTA_FALLBACKS.labels("unsupported").inc()
            return False
        with_meta = _delta_versions(delta)
        body = {
            "delta_path": str(delta.resolve()),
            "base_version": with_meta[0],
            "weight_version": str(version),
            "abort_all_requests": False,
            "flush_cache": True,
        }
        try:
            response = client.post(f"{url.rstrip('/')}{ROUTE}", json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            return self._fallback(url, version, "error", f"{type(exc).__name__}: {exc}")
        if response.status_code in (404, 405):
            self.unsupported.add(url)
            return self._fallback(url, version, "unsupported", f"no {ROUTE} (HTTP 404)")
        try:
            reply = response.json()
        except ValueError:
            reply = {"message": response.text[:200]}
        if response.status_code == 200 and reply.get("success"):
            DELTAS_APPLIED.inc()
            log.info("engine %s applied the delta %s -> %d", url, with_meta[0], version)
            return True
        reason = str(reply.get("reason") or "error")
        return self._fallback(url, version, reason, str(reply.get("message")))

    def full_folder(self, folder: Path, version: int) -> Path:
        """See `DeltaWeightsStore.full_folder`."""
        return self.store.full_folder(folder, version)

    @staticmethod
    def _fallback(url: str, version: int, reason: str, message: str) -> bool:
        DELTA_FALLBACKS.labels(reason).inc()
        log.warning(
            "engine %s did not take the delta to weight version %d (%s: %s); pushing the full "
            "weights",
            url,
            version,
            reason,
            message,
        )
        return False


def _delta_versions(path: Path) -> tuple[str, str]:
    """(base_version, weight_version) from a delta file's metadata."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return meta.get("base_version", ""), meta.get("weight_version", "")


def delta_enabled(settings: Any) -> bool:
    """Whether `trainer.push.delta` is on: true, or auto with a bfloat16 push dtype.

    Raises:
        ConfigurationError: delta = true with push.mode = "distributed" (a broadcast sends
            whole tensors).
    """
    push = settings.trainer.push
    if push.delta is True and push.mode != "disk":
        raise ConfigurationError(
            'trainer.push.delta = true needs trainer.push.mode = "disk"; set delta = "auto" '
            "or false for distributed pushes"
        )
    dtype = push.dtype if push.dtype != "auto" else settings.engine.dtype
    return push.mode == "disk" and (
        push.delta is True or (push.delta == "auto" and dtype == "bfloat16")
    )


def attach_deltas(settings: Any, store: WeightsStore, pusher: Any) -> Any:
    """The `write(version, state) -> folder` function for the background pusher: the delta
    store's when `delta_enabled` (the disk pusher then tries a delta on each engine first),
    else `store.write`."""
    if not delta_enabled(settings):
        return store.write
    deltas = DeltaWeightsStore(store)
    pusher.deltas = DeltaPushes(deltas)
    log.info("delta pushes on: engines get the changed elements after the first full push")
    return deltas.write


def checksums_of(path: Path) -> dict[str, str]:
    """The result digests recorded in a delta file (for tests and tools)."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(path), framework="pt") as f:
        return dict(json.loads((f.metadata() or {}).get("checksums", "{}")))
