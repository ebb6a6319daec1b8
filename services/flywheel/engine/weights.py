"""Weight updates of a running engine: from disk and over torch.distributed (SGLang's routes).

* Disk (`/update_weights_from_disk`): the safetensors checkpoint is read into private buffers,
  validated and converted where its dtype differs (`ModelRunner.prepare`) in the caller's thread
  while the worker keeps decoding; the swap runs on the worker between two decode steps and only
  replaces references (the engine holds the served and the new weights, no third copy).
* Distributed (`/init_weights_update_group`, `/update_weights_from_distributed`,
  `/destroy_weights_update_group`): the engine joins a process group as rank
  `rank_offset` (the trainer is rank 0 and broadcasts); with `engine.emulate_tp_size = N` it
  joins as ranks `rank_offset .. rank_offset + N - 1`, as an SGLang server with `--tp-size N`
  does (one rank per TP worker): the extra ranks are process groups of their own in this
  process, receive every broadcast too, and their copies must equal the first rank's (the
  layout check; the model is still computed on one device). gloo on CPU, NCCL on CUDA. As in
  SGLang 0.5.21+, an update must run inside `/begin_weight_update` ... `/end_weight_update`.
  Tensors are received into fresh buffers in the HTTP thread while the worker keeps decoding and
  validated per call (names and shapes; a partial update is allowed); the calls of one session
  (a trainer's buckets) are staged and swapped in once, at `/end_weight_update`, between two
  decode steps, so no request is ever served by half-updated weights. A mismatch answers
  success false after the broadcast was consumed (so the trainer never hangs); nothing of that
  session is applied and the served weights stay untouched.

`engine.weight_swap = "step"` (default): the swap happens at the next decode-step boundary; rows
in flight continue under the new weights (their next-token logits are recomputed under them, see
`RunningBatch.refresh_logits`) and report the change as `meta_info.weight_versions` spans; no row
waits. `"drain"`: the swap waits until every row that arrived before it has finished on the old
weights and holds rows that arrive after it (one version per request).

Every successful update relabels `weight_version` when one is given. There is no prefix cache
in this engine (`cached_tokens` is always 0), so `flush_cache` has nothing to flush: no KV
computed under old weights is ever reused by a later request (a row in flight keeps the KV of
its own earlier tokens, as SGLang's in-place continue does).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flywheel.engine.runner import CheckpointError

if TYPE_CHECKING:
    from flywheel.engine.worker import EngineWorker

log = logging.getLogger(__name__)

SUPPORTED_LOAD_FORMATS = (None, "auto", "safetensors")
GROUP_TIMEOUT_S = 600.0
"""Seconds a rendezvous or a broadcast may wait for the other ranks."""


@dataclass
class _Group:
    groups: list[Any]
    """ProcessGroupGloo | ProcessGroupNCCL, one per (emulated) TP rank, in rank order."""
    rank: int
    """The first rank (`rank_offset`)."""
    world_size: int
    device: torch.device


@dataclass
class _Session:
    """What the calls of one open weight-update session received (applied at its end)."""

    staged: dict[str, Tensor] = field(default_factory=dict)
    version: str | None = None
    abort_all: bool = False
    error: str = ""
    """Why a call of this session failed (then nothing of it is applied)."""


class WeightUpdater:
    """Weight-update operations of one engine; thread-safe; one update at a time."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._session: _Session | None = None

    # -- disk -------------------------------------------------------------------------------------

    def from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """Load a safetensors checkpoint into the live model (blocking until swapped).

        On any mismatch nothing changes and `(False, reason)` is returned. Rows in flight
        continue under the new weights from the next decode step (`engine.weight_swap =
        "step"`), or finish on the old ones first (`"drain"`, unless paused in place).
        """
        if load_format not in SUPPORTED_LOAD_FORMATS:
            return False, f"load_format {load_format!r} is not supported; use safetensors"
        runner = self.worker.runner
        if self.worker.status != "ready" or runner is None:
            return False, f"the engine is {self.worker.status}"
        with self._lock:
            t0 = time.perf_counter()
            try:
                state = runner.read_checkpoint(Path(model_path))
            except CheckpointError as e:
                self.worker.metrics.weight_updates.labels("failed").inc()
                return False, str(e)
            self._swap(state, weight_version, abort_all_requests, owned=True)
            log.info(
                "weights from %s loaded in %.2f s, version %s",
                model_path,
                time.perf_counter() - t0,
                self.worker.weight_version,
            )
        return True, "Succeeded to update model weights."

    def _swap(
        self, state: dict[str, Tensor], version: str | None, abort_all: bool, *, owned: bool = False
    ) -> None:
        """Swap `state` in between two decode steps; `owned`: its tensors are the engine's own
        reads (`ModelRunner.prepare`), not buffers a caller may still write."""
        runner = self.worker.runner
        assert runner is not None
        if abort_all:
            self.worker.abort("", abort_all=True)

        prepared = runner.prepare(state, owned=owned)  # converted here, off the decode loop

        def swap() -> None:  # between two decode steps: reference swaps only
            runner.apply_weights(prepared)
            self.worker.after_swap(version)

        self.worker.control(swap, drain=self.worker.settings.weight_swap == "drain")
        self.worker.metrics.weight_updates.labels("ok").inc()

    # -- session ----------------------------------------------------------------------------------

    def begin(self, selector: str = "all") -> tuple[bool, str]:
        """SGLang 0.5.21+ `/begin_weight_update`: one session at a time."""
        if selector not in ("all", "target", "draft"):
            return False, f"unknown selector {selector!r}"
        with self._lock:
            if self._session is not None:
                return False, "a weight update session is already open"
            self._session = _Session()
        return True, "Weight update session started."

    def end(self) -> tuple[bool, str]:
        """SGLang 0.5.21+ `/end_weight_update`: swap in what the session's
        `/update_weights_from_distributed` calls received, once (blocking until swapped).
        A session with a failed call applies nothing and answers `(False, reason)`."""
        with self._lock:
            session, self._session = self._session, None
            if session is None:
                return False, "no weight update session is open"
            if session.error:
                return False, f"nothing of this session was applied: {session.error}"
            if session.staged:
                t0 = time.perf_counter()
                self._swap(session.staged, session.version, session.abort_all)
                log.info(
                    "%d tensors applied in %.2f s, version %s",
                    len(session.staged),
                    time.perf_counter() - t0,
                    self.worker.weight_version,
                )
            elif session.version is not None:
                self.worker.set_weight_version(session.version)
        return True, "Weight update session ended."

    # -- distributed ------------------------------------------------------------------------------

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """Join the trainer's process group as ranks `rank_offset .. rank_offset + N - 1`
        (N = `engine.emulate_tp_size`; blocks until every rank of the group joined).

        backend "nccl" on a CPU engine falls back to gloo (nothing else can move CPU tensors).
        """
        runner = self.worker.runner
        if runner is None:
            return False, f"the engine is {self.worker.status}"
        if group_name in self._groups:
            return False, f"group {group_name!r} already exists; destroy it first"
        tp = self.worker.settings.emulate_tp_size
        if not 0 < rank_offset <= world_size - tp:
            return False, (
                f"rank_offset {rank_offset} with tp_size {tp} does not fit world_size "
                f"{world_size}: ranks {rank_offset}..{rank_offset + tp - 1} must lie in "
                f"[1, {world_size - 1}] (rank 0 is the trainer)"
            )
        device = runner.device
        use_nccl = backend == "nccl" and device.type == "cuda"

        def join(tp_rank: int) -> Any:
            return _new_group(
                master_address,
                master_port,
                rank_offset + tp_rank,
                world_size,
                group_name,
                use_nccl,
                device,
            )

        try:  # every rank of this engine joins at once: each blocks until all ranks are in
            with ThreadPoolExecutor(max_workers=tp) as pool:
                groups = list(pool.map(join, range(tp)))
        except Exception as e:  # rendezvous timeout, refused port, bad backend
            log.warning("joining weight update group %s failed: %s", group_name, e)
            return False, f"Failed to init process group: {type(e).__name__}: {e}"
        self._groups[group_name] = _Group(groups, rank_offset, world_size, device)
        log.info(
            "joined weight update group %s as ranks %d..%d of %d (%s)",
            group_name,
            rank_offset,
            rank_offset + tp - 1,
            world_size,
            "nccl" if use_nccl else "gloo",
        )
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        """Leave the group. A weight-update session still open is dropped with it, nothing of
        it applied (its trainer is gone: a trainer that died mid-push left it open)."""
        group = self._groups.pop(group_name, None)
        if group is None:
            return False, f"no group named {group_name!r}"
        with self._lock:
            if self._session is not None:
                log.warning(
                    "weight update session dropped unapplied (%d tensors received) with group %s",
                    len(self._session.staged),
                    group_name,
                )
                self._session = None
        for pg in group.groups:
            shutdown = getattr(pg, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception as e:  # a peer already gone; the group is dropped anyway
                    log.info("shutting down group %s: %s", group_name, e)
        return True, "Succeeded to destroy custom process group."

    def from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> tuple[bool, str]:
        """Receive `names` broadcast by rank 0 (in that order) on every rank of this engine
        and stage them; `end` swaps the session's tensors in.

        Returns `(False, reason)` when no session is open, the group is unknown, a name/shape
        does not fit the model, or an emulated TP rank received other bytes than the first
        (then nothing of the session is applied).
        """
        session = self._session
        if session is None:
            return False, (
                "update_weights_from_distributed must run between "
                "begin_weight_update() and end_weight_update()"
            )
        group = self._groups.get(group_name)
        if group is None:
            return False, f"no weight update group named {group_name!r}; call init first"
        if not len(names) == len(dtypes) == len(shapes):
            return False, "names, dtypes and shapes must have the same length"
        try:
            types = [_dtype(d) for d in dtypes]
        except ValueError as e:
            return False, str(e)
        runner = self.worker.runner
        assert runner is not None
        with self._lock:
            t0 = time.perf_counter()
            state: dict[str, Tensor] = {}
            differ: list[str] = []
            for name, dtype, shape in zip(names, types, shapes, strict=True):
                bufs = [torch.empty(shape, dtype=dtype, device=group.device) for _ in group.groups]
                for work in [pg.broadcast(b, 0) for pg, b in zip(group.groups, bufs, strict=True)]:
                    work.wait()
                if not all(torch.equal(bufs[0], b) for b in bufs[1:]):
                    differ.append(name)
                state[name] = bufs[0]
            try:
                runner.validate(state, "distributed update", complete=False)
                if differ:
                    raise CheckpointError(
                        f"TP ranks {group.rank}..{group.rank + len(group.groups) - 1} received "
                        f"different bytes for {differ[:5]}"
                    )
            except CheckpointError as e:
                self.worker.metrics.weight_updates.labels("failed").inc()
                session.error = str(e)
                return False, str(e)
            session.staged |= state
            session.version = weight_version if weight_version is not None else session.version
            session.abort_all |= abort_all_requests
            log.info(
                "%d tensors received over %s in %.2f s (applied at end_weight_update)",
                len(state),
                group_name,
                time.perf_counter() - t0,
            )
        return True, "Succeeded to update parameter online."

    # -- reads ------------------------------------------------------------------------------------

    def get_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """A parameter as float32 nested lists, first `truncate_size` rows (SGLang, for tests).
        Tied aliases (lm_head.weight of a tied model) answer with the shared tensor.

        Raises:
            KeyError: no parameter has that name.
        """
        runner = self.worker.runner
        if runner is None:
            raise KeyError(name)
        param = runner.parameter(name)
        return self.worker.control(lambda: param.detach().float().cpu().tolist()[:truncate_size])


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def _new_group(
    host: str, port: int, rank: int, world_size: int, name: str, nccl: bool, device: torch.device
) -> Any:
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = PrefixStore(name, TCPStore(host, port, world_size, False, timeout=timeout))
    if nccl:
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(device)
        # the stub lists only the (store, rank, size, options) overload; (..., timeout=default)
        return ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg]
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)
