"""Weight push over a torch.distributed weight-update group, with the disk push as fallback.

`trainer.push.mode = "distributed"`: the trainer (rank 0) and every engine form SGLang's
weight-update group once (`/init_weights_update_group`; gloo on CPU, NCCL on GPU) and each push
broadcasts the servable tensors (LoRA merged, tied embeddings once) inside a
`/begin_weight_update` ... `/end_weight_update` session, labelled with the new
`weight_version`, without aborting in-flight requests (flywheel.trainer.weight_sync). The
checkpoint is still written to disk first (crash safety, resume). If the group cannot be formed
or a broadcast fails, the group is dropped (formed again at the next push) and this push falls
back to `/update_weights_from_disk` on every engine, so no engine is left behind silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from flywheel.trainer.weight_sync import DistributedWeightSync, WeightSyncError
from flywheel.trainer.weights import PushReport, WeightPusher, servable_state

log = logging.getLogger(__name__)


class DistributedPusher:
    """Same interface as `WeightPusher` (`push(path, version) -> PushReport`, `close()`).

    Args:
        disk: the disk pusher used as fallback (its engine URLs are the group's engines).
        model: returns the policy to broadcast (a plain or peft model).
        master_address: address the engines reach this process at.
        backend: "gloo" or "nccl".
        timeout_s: rendezvous and per-call seconds.
    """

    def __init__(
        self,
        disk: WeightPusher,
        model: Callable[[], Any],
        *,
        master_address: str,
        backend: str,
        timeout_s: float,
    ):
        self.disk = disk
        self.model = model
        self.master_address = master_address
        self.backend = backend
        self.timeout_s = timeout_s
        self.sync: DistributedWeightSync | None = None

    @property
    def engine_urls(self) -> list[str]:
        return self.disk.engine_urls

    def push(self, model_path: Path, version: int) -> PushReport:
        """Broadcast the current weights as `version`; on failure, push `model_path` by disk.

        Raises:
            UpstreamError: the fallback disk push failed on every engine.
        """
        t0 = time.perf_counter()
        try:
            if self.sync is None:
                self.sync = DistributedWeightSync(
                    list(self.engine_urls),
                    master_address=self.master_address,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                )
                self.sync.connect()
            base, state = servable_state(self.model())
            named = state.items() if state is not None else base.state_dict().items()
            sent = self.sync.push(named, str(version))
        except (WeightSyncError, RuntimeError, httpx.HTTPError) as exc:
            log.error(
                "distributed weight push of version %d failed (%s); falling back to "
                "/update_weights_from_disk",
                version,
                exc,
            )
            self._drop_group()
            report = self.disk.push(model_path, version)
            report.via = "disk"
            return report
        log.info(
            "broadcast %d tensors of weight version %d to %d engines",
            sent,
            version,
            len(self.engine_urls),
        )
        return PushReport(
            version, list(self.engine_urls), {}, time.perf_counter() - t0, via="distributed"
        )

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
