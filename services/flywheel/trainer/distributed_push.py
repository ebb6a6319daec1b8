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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from flywheel.trainer.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    GROUP_NAME,
    DistributedWeightSync,
    WeightSyncError,
)
from flywheel.trainer.weights import PushReport, WeightPusher

log = logging.getLogger(__name__)


class DistributedPusher:
    """`broadcast(version, snapshot)` over the group; `push(path, version)` by disk.

    Args:
        disk: the disk pusher used as fallback (its engine URLs are the group's engines).
        master_address: address the engines reach this process at.
        master_port: rendezvous port; 0 = a free one each time the group forms.
        backend: "gloo" or "nccl".
        timeout_s: rendezvous and per-call seconds.
        tp_sizes: TP ranks per engine; empty = ask each engine's `/server_info`.
        bucket_bytes: tensor bytes per `/update_weights_from_distributed` call.
        pause: "in_place" = `/pause_generation` in place around each broadcast (an SGLang
            engine loads each bucket at once; the embedded engine swaps at the session's end);
            "abort" = paused in abort mode (rows in flight end with their partial output, which
            the gateway continues under the new weights).

    Raises:
        ValueError: `tp_sizes` given without one entry per engine.
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
    ):
        self.disk = disk
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.timeout_s = timeout_s
        self.tp_sizes = list(tp_sizes or [])
        if self.tp_sizes and len(self.tp_sizes) != len(self.engine_urls):
            raise ValueError(
                f"trainer.push.tp_sizes has {len(self.tp_sizes)} entries for "
                f"{len(self.engine_urls)} engines {self.engine_urls}; give one per engine or "
                "leave it empty to ask each engine's /server_info"
            )
        self.bucket_bytes = bucket_bytes
        self.pause = pause
        self.sync: DistributedWeightSync | None = None

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
        return report

    def broadcast(self, version: int, state: dict[str, torch.Tensor]) -> PushReport | None:
        """Broadcast `state` (a CPU snapshot: name -> tensor in the engines' dtype) as
        `version` to every engine; None when this push must go by disk instead (the group
        could not form or broke: logged, group dropped; or an engine already serves
        `version` or newer)."""
        start, t0 = time.time(), time.perf_counter()
        served = {url: self.disk.served_version(url) for url in self.engine_urls}
        ahead = [url for url, v in served.items() if v is not None and v >= version]
        if ahead:
            log.info(
                "engines %s already serve version %d or newer; this push goes by disk, which "
                "leaves them as they are",
                ahead,
                version,
            )
            return None
        try:
            sync = self._connected()
            with self._paused():
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
            len(self.engine_urls),
            sync.world_size - 1,
            time.perf_counter() - t0,
        )
        span = (start, time.time())
        return PushReport(
            version,
            list(self.engine_urls),
            {},
            time.perf_counter() - t0,
            via="distributed",
            spans=dict.fromkeys(self.engine_urls, span),
        )

    def _connected(self) -> DistributedWeightSync:
        """The group, formed now if there is none. Before forming it, a group of that name left
        on the engines by a trainer that died is destroyed (an engine drops the session that
        trainer left open with it); a group that cannot form is destroyed everywhere too, so
        the next push forms it again.

        Raises:
            WeightSyncError, httpx.HTTPError: the group could not form.
        """
        if self.sync is None:
            self._destroy_leftovers()
            sync = DistributedWeightSync(
                list(self.engine_urls),
                tp_sizes=self.tp_sizes or [self.server_tp_size(u) for u in self.engine_urls],
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

    def _destroy_leftovers(self) -> None:
        for url in self.engine_urls:
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
    def _paused(self) -> Iterator[None]:
        """Pause every engine for the broadcast when `pause` is "in_place" or "abort" (that
        mode of `/pause_generation`)."""
        paused = []
        try:
            if self.pause in ("in_place", "abort"):
                for url in self.engine_urls:
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

    def _drop_group(self) -> None:
        if self.sync is not None:
            try:
                self.sync.close()
            except Exception as exc:  # noqa: BLE001 (best effort on a broken group)
                log.warning("closing the weight update group: %s", exc)
            self.sync = None

    def close(self) -> None:
        self._drop_group()
        self.disk.close()
