"""Trainer-side client: push weights into engines over torch.distributed (SGLang's NCCL path).

Works against the embedded engine (gloo on CPU) and against real SGLang servers (NCCL on GPU)
with the same HTTP calls (docs/engine-protocol.md):

    sync = DistributedWeightSync(["http://a:30000", "http://b:30000"], tp_sizes=[1, 2])
    sync.connect()                                   # rendezvous: trainer = rank 0
    sync.push(model.named_parameters(), weight_version="7")
    sync.close()                                     # /destroy_weights_update_group

Rank layout (SGLang's): every TP rank of an engine is a rank of the group, `rank = rank_offset
+ tp_rank`. The trainer is rank 0; engine i gets `rank_offset = 1 + sum(tp_sizes[:i])` and the
world size is `1 + sum(tp_sizes)` (`rank_layout`). Each TP rank receives every full tensor and
its model loader keeps its own shard.

`push` opens a `/begin_weight_update` session on every engine, then sends the tensors in
buckets of at most `bucket_bytes` (`buckets`): per bucket one `/update_weights_from_distributed`
call (names, dtypes, shapes) to each engine in a thread, while rank 0 broadcasts the bucket's
tensors in that order; then it closes the session with `/end_weight_update`. Only the last
bucket carries `weight_version` and `flush_cache`, so the version label changes once, when
every tensor is in. Tied weights (one storage under two names, e.g. `lm_head.weight` and
`model.embed_tokens.weight`) are sent once, under the first name (BUG-18).
`abort_all_requests` is always sent explicitly (BUG-16).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from torch import Tensor

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024**2
"""Bytes of tensors per `/update_weights_from_distributed` call (slime's default bucket)."""


GROUP_NAME = "weight_update_group"
"""SGLang's default name of the weight-update group."""


class WeightSyncError(RuntimeError):
    """An engine refused a weight-sync call; the message names the engine and its reason."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def unique_tensors(named: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """Drop aliases: a tensor whose storage was already listed (tied embeddings) is skipped."""
    seen: set[int] = set()
    out = []
    for name, tensor in named:
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def rank_layout(tp_sizes: list[int]) -> tuple[list[int], int]:
    """SGLang's ranks for engines with `tp_sizes` TP ranks each, the trainer being rank 0.

    Returns:
        (rank_offset of each engine, world size). Example: tp_sizes [1, 2, 4] -> offsets
        [1, 1+1=2, 1+1+2=4], world size 1+1+2+4 = 8 (ranks 0 | 1 | 2,3 | 4,5,6,7).

    Raises:
        ValueError: a TP size below 1.
    """
    if any(n < 1 for n in tp_sizes):
        raise ValueError(f"every engine needs a tp_size >= 1, got {tp_sizes}")
    offsets, next_rank = [], 1
    for n in tp_sizes:
        offsets.append(next_rank)
        next_rank += n
    return offsets, next_rank


def buckets(items: list[tuple[str, Tensor]], bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Consecutive runs of `items` of at most `bucket_bytes` bytes each (order kept); a tensor
    larger than `bucket_bytes` is a bucket of its own.

    Example: sizes [40, 40, 30, 100, 10] bytes with bucket_bytes 100 -> [[40, 40], [30],
    [100], [10]] (40+40+30 = 110 > 100 closes the first; 30+100 > 100 the second).

    Raises:
        ValueError: bucket_bytes < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[tuple[str, Tensor]]] = []
    size = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


@dataclass
class DistributedWeightSync:
    """One weight-update group spanning this trainer (rank 0) and every TP rank of
    `engine_urls`.

    Args:
        engine_urls: engine base URLs (no /v1).
        tp_sizes: TP ranks of each engine (SGLang's `tp_size`, `/server_info`); empty = 1 each.
        master_address: address the engines can reach this process at.
        master_port: TCP store port; 0 = pick a free one.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors, SGLang on GPU).
        group_name: SGLang's group name.
        timeout_s: seconds for the rendezvous and for each HTTP call.
        bucket_bytes: tensor bytes per `/update_weights_from_distributed` call.

    Raises:
        ValueError: `tp_sizes` does not have one entry per engine, or an entry below 1.
    """

    engine_urls: list[str]
    tp_sizes: list[int] = field(default_factory=list)
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    group_name: str = GROUP_NAME
    timeout_s: float = 600.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    _group: Any = field(default=None, init=False, repr=False)
    _store: Any = field(default=None, init=False, repr=False)
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.tp_sizes:
            self.tp_sizes = [1] * len(self.engine_urls)
        if len(self.tp_sizes) != len(self.engine_urls):
            raise ValueError(
                f"{len(self.tp_sizes)} tp_sizes for {len(self.engine_urls)} engines; give one "
                "per engine"
            )
        self.rank_offsets, self._world_size = rank_layout(self.tp_sizes)

    @property
    def world_size(self) -> int:
        """1 (the trainer) + the TP ranks of every engine."""
        return self._world_size

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http.post(f"{url}{path}", json=body, timeout=self.timeout_s)
        try:
            data = r.json()
        except ValueError:
            data = {"success": False, "message": r.text}
        if r.status_code != 200 or not data.get("success", False):
            raise WeightSyncError(f"{url}{path} failed ({r.status_code}): {data.get('message')}")
        return data

    def _on_all(
        self, path: str, bodies: list[dict[str, Any]]
    ) -> tuple[list[threading.Thread], list[BaseException]]:
        errors: list[BaseException] = []

        def call(url: str, body: dict[str, Any]) -> None:
            try:
                self._post(url, path, body)
            except BaseException as e:  # collected and raised by the caller after join
                errors.append(e)

        threads = [
            threading.Thread(target=call, args=(u, b), daemon=True)
            for u, b in zip(self.engine_urls, bodies, strict=True)
        ]
        for t in threads:
            t.start()
        return threads, errors

    def _join(self, threads: list[threading.Thread], errors: list[BaseException]) -> None:
        for t in threads:
            t.join(self.timeout_s)
        if any(t.is_alive() for t in threads):
            errors.append(WeightSyncError(f"an engine did not answer within {self.timeout_s} s"))

    def connect(self) -> None:
        """Create the group: the engines' /init_weights_update_group calls and this process's
        rendezvous run concurrently (each side blocks until all ranks joined).

        Raises:
            WeightSyncError: an engine refused or the rendezvous timed out.
        """
        from torch.distributed import PrefixStore, TCPStore

        if not self.master_port:
            self.master_port = free_port(self.master_address)
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": offset,
                "world_size": self.world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for offset in self.rank_offsets
        ]
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = TCPStore(
            self.master_address,
            self.master_port,
            self.world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
        )
        threads, errors = self._on_all("/init_weights_update_group", bodies)
        try:
            prefixed = PrefixStore(self.group_name, store)
            if self.backend == "nccl":
                from torch.distributed import ProcessGroupNCCL

                # the stub lists only the (store, rank, size, options) overload, not
                # (store, rank, size, timeout=default)
                self._group = ProcessGroupNCCL(prefixed, 0, self.world_size)  # type: ignore[call-arg]
            else:
                from torch.distributed import ProcessGroupGloo

                self._group = ProcessGroupGloo(prefixed, 0, self.world_size, timeout)
        finally:
            self._join(threads, errors)
        self._store = store  # keep the master store alive as long as the group
        if errors:
            raise WeightSyncError(str(errors[0])) from errors[0]

    def push(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        weight_version: str,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> int:
        """Broadcast tensors into every engine, bucket by bucket, inside a begin/end
        weight-update session.

        Args:
            named_tensors: (HF parameter name, tensor); tensors must sit on the backend's
                device (CPU for gloo, CUDA for nccl). Partial updates are allowed.
            weight_version: the label the engines report from now on (sent with the last
                bucket).
            abort_all_requests: abort in-flight requests first (False lets them finish).

        Returns:
            the number of tensors sent (tied aliases counted once).

        Raises:
            WeightSyncError: not connected, or an engine refused a bucket (the buckets after
                it are not sent).
        """
        if self._group is None:
            raise WeightSyncError("call connect() first")
        items = [(n, t.detach().contiguous()) for n, t in unique_tensors(named_tensors)]
        parts = buckets(items, self.bucket_bytes)
        for url in self.engine_urls:
            self._post(url, "/begin_weight_update", {})
        try:
            for i, bucket in enumerate(parts):
                last = i == len(parts) - 1
                self._send_bucket(
                    bucket,
                    weight_version if last else None,
                    flush_cache=flush_cache and last,
                    abort_all_requests=abort_all_requests and i == 0,
                )
        finally:
            for url in self.engine_urls:
                try:
                    self._post(url, "/end_weight_update", {})
                except (WeightSyncError, httpx.HTTPError) as e:
                    log.warning("closing the weight update session on %s: %s", url, e)
        return len(items)

    def _send_bucket(
        self,
        bucket: list[tuple[str, Tensor]],
        weight_version: str | None,
        *,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> None:
        body: dict[str, Any] = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        body |= {"flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        cuda = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        threads, errors = self._on_all(
            "/update_weights_from_distributed", [body] * len(self.engine_urls)
        )
        try:
            with torch.no_grad():
                for _, tensor in bucket:  # NCCL: one bucket at a time on the GPU
                    self._group.broadcast(tensor if cuda is None else tensor.to(cuda), 0).wait()
        finally:
            self._join(threads, errors)
        if errors:
            raise WeightSyncError(str(errors[0])) from errors[0]

    def close(self, engines: Iterable[str] | None = None) -> None:
        """Destroy the group on `engines` (default: every engine of the group) and here, and
        release the rendezvous port (errors are logged, not raised). A group re-formed for a
        changed fleet is destroyed on its surviving members only: an engine that left keeps
        its stale group until a trainer forms one with it again (`/destroy_weights_update_group`
        of left-over groups first)."""
        for url in self.engine_urls if engines is None else engines:
            try:
                self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
            except (WeightSyncError, httpx.HTTPError) as e:
                log.warning("destroying the weight update group on %s: %s", url, e)
        self._group = None
        self._store = None
        self._http.close()
