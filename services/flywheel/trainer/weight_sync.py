"""Trainer-side client: push weights into engines over torch.distributed (SGLang's NCCL path).

Works against the embedded engine (gloo on CPU) and against real SGLang servers (NCCL on GPU)
with the same HTTP calls (docs/engine-protocol.md):

    sync = DistributedWeightSync(["http://127.0.0.1:30000"], backend="gloo")
    sync.connect()                                   # rendezvous: trainer = rank 0
    sync.push(model.named_parameters(), weight_version="7")
    sync.close()                                     # /destroy_weights_update_group

`push` opens a `/begin_weight_update` session on every engine, posts
`/update_weights_from_distributed` (names, dtypes, shapes) to each in a thread and broadcasts
every tensor from rank 0 in the same order while those calls are outstanding, then closes the
session with `/end_weight_update`. Tied weights (one storage under two names, e.g.
`lm_head.weight` and `model.embed_tokens.weight`) are sent once, under the first name
(BUG-18). `abort_all_requests` is always sent explicitly (BUG-16).
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


@dataclass
class DistributedWeightSync:
    """One weight-update group spanning this trainer (rank 0) and `engine_urls` (ranks 1..N).

    Args:
        engine_urls: engine base URLs (no /v1).
        master_address: address the engines can reach this process at.
        master_port: TCP store port; 0 = pick a free one.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors, SGLang on GPU).
        group_name: SGLang's group name.
        timeout_s: seconds for the rendezvous and for each HTTP call.
    """

    engine_urls: list[str]
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    group_name: str = "weight_update_group"
    timeout_s: float = 600.0
    _group: Any = field(default=None, init=False, repr=False)
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(), init=False, repr=False)

    @property
    def world_size(self) -> int:
        return 1 + len(self.engine_urls)

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
                "rank_offset": 1 + i,
                "world_size": self.world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for i in range(len(self.engine_urls))
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
            for t in threads:
                t.join(self.timeout_s)
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
        """Broadcast tensors into every engine inside a begin/end weight-update session.

        Args:
            named_tensors: (HF parameter name, tensor); tensors must sit on the backend's
                device (CPU for gloo, CUDA for nccl). Partial updates are allowed.
            weight_version: the label the engines report from now on.
            abort_all_requests: abort in-flight requests first (False lets them finish).

        Returns:
            the number of tensors sent (tied aliases counted once).

        Raises:
            WeightSyncError: not connected, or an engine refused (its weights are unchanged).
        """
        if self._group is None:
            raise WeightSyncError("call connect() first")
        items = [(n, t.detach().contiguous()) for n, t in unique_tensors(named_tensors)]
        body = {
            "names": [n for n, _ in items],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "group_name": self.group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        for url in self.engine_urls:
            self._post(url, "/begin_weight_update", {})
        try:
            threads, errors = self._on_all(
                "/update_weights_from_distributed", [body] * len(self.engine_urls)
            )
            with torch.no_grad():
                for _, tensor in items:
                    self._group.broadcast(tensor, 0).wait()
            for t in threads:
                t.join(self.timeout_s)
        finally:
            for url in self.engine_urls:
                try:
                    self._post(url, "/end_weight_update", {})
                except (WeightSyncError, httpx.HTTPError) as e:
                    log.warning("closing the weight update session on %s: %s", url, e)
        if errors:
            raise WeightSyncError(str(errors[0])) from errors[0]
        return len(items)

    def close(self) -> None:
        """Destroy the group on every engine and here (errors are logged, not raised)."""
        for url in self.engine_urls:
            try:
                self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
            except (WeightSyncError, httpx.HTTPError) as e:
                log.warning("destroying the weight update group on %s: %s", url, e)
        self._group = None
        self._http.close()
