"""Training the recorded steps after the newest checkpoint again, after a crash or a stop
without a checkpoint covering them (commits.py, docs/streams.md "Exactly-once training")."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flywheel.trainer.commits import CommitRecord, restore_rng
from flywheel.trainer.telemetry import REPLAY_MISSING, REPLAYED_STEPS

if TYPE_CHECKING:
    from flywheel.trainer.service import Trainer

log = logging.getLogger(__name__)


def replay(trainer: Trainer, records: Sequence[CommitRecord]) -> None:
    """Train recorded steps again, in order, with their recorded groups, treatments and
    RNG states (the steps after the newest checkpoint of a trainer that crashed)."""
    first = records[0].step
    if first != trainer.version + 1:
        log.error(
            "commit log starts at step %d after checkpoint %d: steps in between are lost",
            first,
            trainer.version,
        )
    for record in records:
        if trainer._stop.is_set():  # the rest stay recorded, trained after a restart
            return
        entries = trainer._redis(
            lambda r=record: trainer.parts.consumer.claim(r.entry_ids),
            f"claiming the entries of step {record.step}",
        )
        if entries is None:
            log.warning(
                "source %s cannot give entries back; recorded steps %d-%d are not trained again",
                trainer.parts.consumer.kind,
                record.step,
                records[-1].step,
            )
            return
        groups, missing = record.groups_of(entries)
        if missing:
            REPLAY_MISSING.inc(len(missing))
            log.error(
                "step %d: %d recorded entries are no longer pending (acked or deleted) and "
                "are left out: %s",
                record.step,
                len(missing),
                missing[:5],
            )
        trainer.parts.leases.hold([e.entry_id for e in entries])
        log.info("training recorded step %d again (%d groups)", record.step, len(groups))
        REPLAYED_STEPS.inc()
        restore_rng(record.rng)
        if groups:
            trainer._replaying = True
            try:
                trainer._train(groups, [], time.perf_counter())
            finally:
                trainer._replaying = False
