"""Weight push over a torch.distributed weight-update group, with the disk push as fallback.

`trainer.push.mode = "distributed"`: the trainer (rank 0) and every TP rank of every engine form
SGLang's weight-update group once (`/init_weights_update_group`; gloo on CPU, NCCL on GPU). The
rank layout is SGLang's: engine i joins at `rank_offset = 1 + sum of the TP sizes before it`,
the world size is `1 + sum of all TP sizes` (`trainer.push.tp_sizes`, or each engine's
`/server_info` `tp_size`). Each push broadcasts a CPU snapshot of the servable tensors (LoRA
merged, tied embeddings once, in the engines' dtype) in buckets of `trainer.push.bucket_mb`
inside a `/begin_weight_update` ... `/end_weight_update` session, labelled with the new
`weight_version`, without aborting in-flight requests (flywheel.trainer.weight_sync). Because
it reads a snapshot, not the live model, it runs in the background pusher while the next step
trains (flywheel.trainer.background), one push at a time.

The disk path stays the fallback: if the group cannot be formed or a broadcast fails, the
group is dropped (formed again at the next push) and this push goes by
`/update_weights_from_disk` to every engine, so no engine is left behind silently. An engine
that already serves this version or a newer one (a resumed trainer) also sends the push by
disk, which leaves that engine as it is: versions never go backwards on an engine.

A changing fleet (docs/fleet.md). The engines are the shared fleet's at each push (or the fixed
`trainer.push.engine_urls`). Before each broadcast the fleet's members and their TP sizes are
compared with the group's; when an engine joined or left, or its TP size changed, the group is
destroyed on its surviving members and here, and formed again over the new members with the
rank offsets recomputed (logged, `flywheel_trainer_push_group_reforms_total{reason}`). An
engine that left keeps its stale group until a trainer forms one with it again (left-over
groups are destroyed first). While a broadcast runs it holds the disk pusher's lock of every
member, so no disk push to a member (the fleet watcher's) overlaps it.

An engine that joins between pushes gets the current weights from the fleet watcher before a
gateway routes to it, by disk: the snapshot of the newest broadcast is kept (the background
pusher's own copy, not a second one: one CPU copy of the servable weights in the push dtype
stays alive between pushes), and when the watcher finds a member behind it the snapshot is
written once as a weights folder under `checkpoint_dir/joiners/` (emptied when the trainer
starts: nothing there is this run's) and loaded by
`/update_weights_from_disk` on that engine only (`latest_folder`). A broadcast to a joiner
alone cannot be done in the group without sending the weights to every member again, and the
disk path leaves the engines already serving the version untouched; the next push then
re-forms the group with the joiner in it. The tensors it loads are the same bits a broadcast
sends (tests/integration/test_distributed_fleet.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import torch
from prometheus_client import Counter

from flywheel.core.fleet import normalize_url
from flywheel.trainer.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    GROUP_NAME,
    DistributedWeightSync,
    WeightSyncError,
)
from flywheel.trainer.weights import PushReport, WeightPusher, WeightsStore

log = logging.getLogger(__name__)
GROUP_REFORMS = Counter(
    "flywheel_trainer_push_group_reforms_total",
    "Weight-update groups destroyed and formed again because the fleet changed, by reason "
    "(joined, left, tp_size, or mixed when several)",
    ["reason"],
)


def reform_reason(old: dict[str, int], new: dict[str, int]) -> str | None:
    """Why a group formed over `old` (engine URL -> TP size) must be formed again for the
    members `new`: "joined", "left", "tp_size", or "mixed" when more than one; None = same
    members and TP sizes (the same rank layout: URLs are laid out in the fleet's sorted order).

    Example: old {a: 1, b: 1}, new {a: 1, b: 1, c: 2} -> "joined"; new {a: 1} -> "left";
    new {a: 1, b: 2} -> "tp_size"; new {a: 2, c: 1} -> "mixed".
    """
    reasons = set()
    if set(new) - set(old):
        reasons.add("joined")
    if set(old) - set(new):
        reasons.add("left")
    if any(old[url] != new[url] for url in set(old) & set(new)):
        reasons.add("tp_size")
    if not reasons:
        return None
    return reasons.pop() if len(reasons) == 1 else "mixed"


class DistributedPusher:
    """`broadcast(version, snapshot)` over the group; `push(path, version)` by disk.

    Args:
        disk: the disk pusher used as fallback (its engine URLs are the group's engines).
        master_address: address the engines reach this process at.
        master_port: rendezvous port; 0 = a free one each time the group forms.
        backend: "gloo" or "nccl".
        timeout_s: rendezvous and per-call seconds.
        tp_sizes: TP ranks of each configured engine (`disk.static_urls`, in that order);
            empty = ask each engine's `/server_info`, as for every engine that joined the fleet.
        bucket_bytes: tensor bytes per `/update_weights_from_distributed` call.
        joiners: where the kept snapshot is written for an engine that joined
            (`latest_folder`); None = joiners get only the disk path's newest folder.
        pause: "in_place" = `/pause_generation` in place around each broadcast (an SGLang
            engine loads each bucket at once; the embedded engine swaps at the session's end);
            "abort" = paused in abort mode (rows in flight end with their partial output, which
            the gateway continues under the new weights).

    Raises:
        ValueError: `tp_sizes` given without one entry per configured engine.
    """

    def __init__(
        self,
        disk: WeightPusher,
        *,
        master_address: str,
        backend: str,
        timeout_s: float,
        master_port: int = 0,
        tp_sizes: list[int] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pause: str = "none",
        joiners: WeightsStore | None = None,
    ):
        self.disk = disk
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.timeout_s = timeout_s
        self.tp_sizes = list(tp_sizes or [])
        configured = list(disk.static_urls)
        if self.tp_sizes and len(self.tp_sizes) != len(configured):
            raise ValueError(
                f"trainer.push.tp_sizes has {len(self.tp_sizes)} entries for "
                f"{len(configured)} engines {configured}; give one per engine or "
                "leave it empty to ask each engine's /server_info"
            )
        self.configured_tp = {
            normalize_url(u): n for u, n in zip(configured, self.tp_sizes, strict=False)
        }
        self.bucket_bytes = bucket_bytes
        self.pause = pause
        self.joiners = joiners
        self.sync: DistributedWeightSync | None = None
        self.latest_snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        """(version, CPU snapshot) of the newest broadcast: the background pusher's own copy,
        kept for engines that join (`latest_folder`); dropped once a disk push is newer."""
        self._folder_lock = threading.Lock()
        if disk.watcher is not None:  # the fleet watcher finds the newest weights here
            disk.watcher.weights = self

    @property
    def engine_urls(self) -> list[str]:
        return self.disk.engine_urls

    def push(self, model_path: Path, version: int) -> PushReport:
        """The disk path: `/update_weights_from_disk` of `model_path` on every engine.

        Raises:
            UpstreamError: every engine failed.
        """
        report = self.disk.push(model_path, version)
        report.via = "disk"
        kept = self.latest_snapshot
        if kept is not None and kept[0] <= version:  # the folder is as new: one copy less
            self.latest_snapshot = None
        return report

    def latest_version(self) -> int | None:
        """The newest version pushed (broadcast or by disk); None before the first push."""
        kept, folder = self.latest_snapshot, self.disk.latest
        versions = [v for v in (kept and kept[0], folder and folder[1]) if v is not None]
        return max(versions, default=None)

    def latest_folder(self) -> tuple[Path, int] | None:
        """(weights folder, version) of the newest pushed weights, for an engine that joined:
        the disk path's newest folder, or the kept broadcast snapshot written once under
        `joiners` (the newest two kept). None before the first push.

        Raises:
            OSError: the disk refused the write.
        """
        with self._folder_lock:
            kept, folder = self.latest_snapshot, self.disk.latest
            if kept is None or self.joiners is None or (folder and folder[1] >= kept[0]):
                return folder
            version, state = kept
            t0 = time.perf_counter()
            path = self.joiners.write(version, state)
            log.info(
                "wrote the broadcast weight version %d to %s for engines that joined (%.2f s)",
                version,
                path,
                time.perf_counter() - t0,
            )
            if self.disk.latest is None or self.disk.latest[1] < version:
                self.disk.latest = (path, version)
            return path, version

    def broadcast(self, version: int, state: dict[str, torch.Tensor]) -> PushReport | None:
        """Broadcast `state` (a CPU snapshot: name -> tensor in the engines' dtype) as
        `version` to every engine; None when this push must go by disk instead (the group
        could not form or broke: logged, group dropped; or an engine already serves
        `version` or newer)."""
        start, t0 = time.time(), time.perf_counter()
        self.latest_snapshot = (version, state)  # a reference: the caller's copy, not another
        urls = list(self.engine_urls)
        if not urls:
            return None  # the disk path logs the empty fleet
        try:
            with self._members_locked(urls):
                served = {url: self.disk.served_version(url) for url in urls}
                ahead = [url for url, v in served.items() if v is not None and v >= version]
                if ahead:
                    log.info(
                        "engines %s already serve version %d or newer; this push goes by disk, "
                        "which leaves them as they are",
                        ahead,
                        version,
                    )
                    return None
                sync = self._connected(urls)
                with self._paused(urls):
                    sent = sync.push(state.items(), str(version))
        except (WeightSyncError, RuntimeError, ValueError, httpx.HTTPError) as exc:
            log.error(
                "distributed weight push of version %d failed (%s); falling back to "
                "/update_weights_from_disk",
                version,
                exc,
            )
            self._drop_group()
            return None
        log.info(
            "broadcast %d tensors of weight version %d to %d engines (%d ranks) in %.2f s",
            sent,
            version,
            len(urls),
            sync.world_size - 1,
            time.perf_counter() - t0,
        )
        if self.disk.fleet is not None:  # gateways hold back engines serving less
            try:
                self.disk.fleet.set_version(version)
            except Exception as exc:  # noqa: BLE001 (redis errors: the push stands)
                log.warning("fleet version not recorded (%s)", exc)
        span = (start, time.time())
        return PushReport(
            version,
            urls,
            {},
            time.perf_counter() - t0,
            via="distributed",
            spans=dict.fromkeys(urls, span),
        )

    @contextmanager
    def _members_locked(self, urls: list[str]) -> Iterator[None]:
        """Hold the disk pusher's lock of every engine in `urls` (sorted order), so no disk
        push to one of them (the fleet watcher's) runs during the broadcast.

        Raises:
            WeightSyncError: a disk push to one of them still ran after `timeout_s`.
        """
        with ExitStack() as held:
            for url in sorted(urls):
                lock = self.disk._lock(url)
                if not lock.acquire(timeout=self.timeout_s):
                    raise WeightSyncError(
                        f"a disk push to {url} still runs after {self.timeout_s} s"
                    )
                held.callback(lock.release)
            yield

    def tp_size(self, url: str) -> int:
        """TP ranks of `url`: its `trainer.push.tp_sizes` entry, else its `/server_info`.

        Raises:
            WeightSyncError, httpx.HTTPError: the engine does not say (see `server_tp_size`).
        """
        configured = self.configured_tp.get(normalize_url(url))
        return configured if configured is not None else self.server_tp_size(url)

    def _connected(self, urls: list[str]) -> DistributedWeightSync:
        """The group over `urls`, formed now if there is none. A group formed over other
        members or TP sizes (the fleet changed) is destroyed on its surviving members and
        formed again (counted by reason). Before forming, a group of that name left on the
        engines by a trainer that died is destroyed (an engine drops the session that trainer
        left open with it); a group that cannot form is destroyed everywhere too, so the next
        push forms it again.

        Raises:
            WeightSyncError, httpx.HTTPError: the group could not form.
        """
        members = {url: self.tp_size(url) for url in urls}
        if self.sync is not None:
            old = dict(zip(self.sync.engine_urls, self.sync.tp_sizes, strict=True))
            reason = reform_reason(old, members)
            if reason is not None:
                log.info(
                    "the fleet changed (%s: joined %s, left %s); destroying the weight update "
                    "group of %d ranks and forming it again over %d engines",
                    reason,
                    sorted(set(members) - set(old)),
                    sorted(set(old) - set(members)),
                    self.sync.world_size,
                    len(members),
                )
                GROUP_REFORMS.labels(reason).inc()
                self._drop_group([url for url in old if url in members])
        if self.sync is None:
            self._destroy_leftovers(urls)
            sync = DistributedWeightSync(
                list(urls),
                tp_sizes=list(members.values()),
                master_address=self.master_address,
                master_port=self.master_port,
                backend=self.backend,
                timeout_s=self.timeout_s,
                bucket_bytes=self.bucket_bytes,
            )
            try:
                sync.connect()
            except BaseException:
                sync.close()
                raise
            self.sync = sync
        return self.sync

    def _destroy_leftovers(self, urls: list[str]) -> None:
        for url in urls:
            try:
                r = self.disk.client.post(
                    f"{url.rstrip('/')}/destroy_weights_update_group",
                    json={"group_name": GROUP_NAME},
                    timeout=60,
                )
            except httpx.HTTPError as exc:
                log.warning("engine %s: destroying a left-over group failed: %s", url, exc)
                continue
            if r.status_code == 200 and r.json().get("success"):
                log.warning("engine %s had a weight update group left by an earlier trainer", url)

    def server_tp_size(self, url: str) -> int:
        """`tp_size` of `url`'s `/server_info` (`/get_server_info` on servers before 0.5.12).

        Raises:
            WeightSyncError: the engine does not say, or runs dp_size > 1 (SGLang's distributed
                update needs dp_size 1).
        """
        info: dict = {}
        for path in ("/server_info", "/get_server_info"):
            r = self.disk.client.get(f"{url.rstrip('/')}{path}", timeout=30)
            if r.status_code == 200:
                info = r.json()
                break
        tp, dp = info.get("tp_size"), info.get("dp_size", 1)
        if not isinstance(tp, int) or tp < 1:
            raise WeightSyncError(
                f"engine {url} reports no tp_size in /server_info; set trainer.push.tp_sizes"
            )
        if dp != 1:
            raise WeightSyncError(
                f"engine {url} runs dp_size {dp}; SGLang's distributed weight update needs "
                "dp_size 1 (use trainer.push.mode = 'disk')"
            )
        return tp

    @contextmanager
    def _paused(self, urls: list[str] | None = None) -> Iterator[None]:
        """Pause every engine of `urls` (default: the fleet's now) for the broadcast when
        `pause` is "in_place" or "abort" (that mode of `/pause_generation`)."""
        paused = []
        try:
            if self.pause in ("in_place", "abort"):
                for url in self.engine_urls if urls is None else urls:
                    r = self.disk.client.post(
                        f"{url.rstrip('/')}/pause_generation", json={"mode": self.pause}, timeout=60
                    )
                    if r.status_code == 200:
                        paused.append(url)
                    else:
                        log.warning(
                            "engine %s refused to pause (%s, %s)", url, self.pause, r.status_code
                        )
            yield
        finally:
            for url in paused:
                self.disk.client.post(f"{url.rstrip('/')}/continue_generation", json={}, timeout=60)

    def _drop_group(self, engines: list[str] | None = None) -> None:
        """Destroy the group on `engines` (default: all its engines) and here."""
        if self.sync is not None:
            try:
                self.sync.close(engines)
            except Exception as exc:  # noqa: BLE001 (best effort on a broken group)
                log.warning("closing the weight update group: %s", exc)
            self.sync = None

    def close(self) -> None:
        self._drop_group()
        self.disk.close()
