"""Group assembly, admission and staleness control for the trainer's input stream.

Samples of one prompt share a `group_id`; group baselines (GRPO, RLOO) need the group together.
`GroupAssembler` is pure bookkeeping (no Redis, no torch): the service feeds it stream entries and
acts on what it returns (train the groups, ack or dead-letter the drops). Every drop carries a
reason, which the service counts and logs: data loss is never silent.

Policy:
- A group is ready when it has `group_size` samples, or when its first sample has waited
  `group_wait_s` (a partial group). A step starts when `groups_per_step` groups are ready, or
  earlier when any ready group has waited `group_wait_s` (then with the ready groups there are).
- A ready group trains only with at least 2 fresh members. A lone sample has no group baseline
  (its advantage would be 0: no gradient, only a diluted token mean), so it is dropped as
  `partial_group_singleton`. With `group_size` 1 every sample is dropped this way.
- Admission drops (on arrival): `no_reward` (has_reward false: scoring failed; dead-lettered with
  the scorer's error, so it can be inspected and replayed), `invalid` (breaks a per-token
  invariant; dead-lettered), `no_group_id` (live-mode samples: they get their own advantage
  estimators later; acked), `truncated_sampling` (top_p < 1, top_k > 0 or min_p > 0 and not
  allowed: BUG-08; acked), `duplicate` (a sample_id already held or recently trained; acked).
- Step drops: `nonfinite_step` (the step that used the sample had a non-finite loss or gradient
  norm and was skipped; dead-lettered), `no_loss_tokens` (the whole step had no sampled token
  to train; acked).
  A re-delivery of an entry already held is ignored (the held copy is acked after training).
- Staleness, at the time a group is taken for a step: lag = trainer version - the oldest weight
  version of the sample's sampled tokens (staleness is measured from dispatch, BUG-19). A sampled
  token without a version (< 0) counts as version 0, the initial weights. Samples with lag >
  `max_staleness` are dropped as `stale` (acked).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from flywheel._proto import sample_pb2
from flywheel.core.errors import ContractError
from flywheel.core.streams import StreamEntry
from flywheel.trainer.samples import check_trainable, sample_lag, truncated_sampling


class DropReason(StrEnum):
    NO_REWARD = "no_reward"
    INVALID = "invalid"
    NO_GROUP_ID = "no_group_id"
    TRUNCATED_SAMPLING = "truncated_sampling"
    DUPLICATE = "duplicate"
    STALE = "stale"
    SINGLETON = "partial_group_singleton"
    NONFINITE_STEP = "nonfinite_step"
    NO_LOSS_TOKENS = "no_loss_tokens"

    @property
    def dead_letter(self) -> bool:
        """Dead-letter (keep the payload with its error) rather than just ack."""
        return self in (DropReason.NO_REWARD, DropReason.INVALID, DropReason.NONFINITE_STEP)


@dataclass(frozen=True)
class Drop:
    entry: StreamEntry
    reason: DropReason
    detail: str = ""


@dataclass
class Group:
    group_id: str
    first_seen_s: float
    """Clock time (seconds) the first member arrived."""
    entries: list[StreamEntry] = field(default_factory=list)

    @property
    def samples(self) -> list[sample_pb2.Sample]:
        return [e.sample for e in self.entries]


class GroupAssembler:
    """Collects admitted entries by group_id and hands out ready groups.

    Args:
        group_size: members that make a group complete.
        group_wait_s: seconds after its first member that a partial group becomes ready.
        allow_truncated_sampling: admit top-p/top-k/min-p samples (see module docstring).
        clock: monotonic seconds (injected by tests).
        remember: trained sample_ids remembered to reject duplicates.
    """

    def __init__(
        self,
        group_size: int,
        group_wait_s: float,
        *,
        allow_truncated_sampling: bool = False,
        clock: Callable[[], float] = time.monotonic,
        remember: int = 100_000,
    ):
        self.group_size = group_size
        self.group_wait_s = group_wait_s
        self.allow_truncated_sampling = allow_truncated_sampling
        self.clock = clock
        self.remember = remember
        self.pending: dict[str, Group] = {}
        self._held_ids: set[str] = set()
        self._held_samples: set[str] = set()
        self._trained: OrderedDict[str, None] = OrderedDict()

    def add(self, entry: StreamEntry) -> Drop | None:
        """Admit one entry into its group, or return why it is dropped (None: admitted or a
        re-delivery of an entry already held)."""
        if entry.entry_id in self._held_ids:
            return None
        drop = self._admission_drop(entry)
        if drop is not None:
            return drop
        sample = entry.sample
        group = self.pending.get(sample.group_id)
        if group is None:
            group = self.pending[sample.group_id] = Group(sample.group_id, self.clock())
        group.entries.append(entry)
        self._held_ids.add(entry.entry_id)
        self._held_samples.add(sample.sample_id)
        return None

    def _admission_drop(self, entry: StreamEntry) -> Drop | None:
        sample = entry.sample
        if not sample.has_reward:
            return Drop(entry, DropReason.NO_REWARD, sample.error or "has_reward is false")
        try:
            check_trainable(sample)
        except ContractError as exc:
            return Drop(entry, DropReason.INVALID, str(exc))
        if not sample.group_id:
            return Drop(entry, DropReason.NO_GROUP_ID)
        if truncated_sampling(sample) and not self.allow_truncated_sampling:
            s = sample.sampling
            detail = f"top_p={s.top_p:g} top_k={s.top_k} min_p={s.min_p:g}"
            return Drop(entry, DropReason.TRUNCATED_SAMPLING, detail)
        if sample.sample_id in self._held_samples or sample.sample_id in self._trained:
            return Drop(entry, DropReason.DUPLICATE, f"sample_id {sample.sample_id}")
        return None

    def _is_ready(self, group: Group, now: float) -> bool:
        return len(group.entries) >= self.group_size or self._overdue(group, now)

    def _overdue(self, group: Group, now: float) -> bool:
        return now - group.first_seen_s >= self.group_wait_s

    def ready_count(self) -> int:
        now = self.clock()
        return sum(self._is_ready(g, now) for g in self.pending.values())

    def should_step(self, groups_per_step: int) -> bool:
        """Enough ready groups for a step, or a ready group that has waited `group_wait_s`."""
        now = self.clock()
        ready = [g for g in self.pending.values() if self._is_ready(g, now)]
        return len(ready) >= groups_per_step or any(self._overdue(g, now) for g in ready)

    def pop_ready(
        self, max_groups: int, trainer_version: int, max_staleness: int
    ) -> tuple[list[Group], list[Drop], list[int]]:
        """Take up to `max_groups` ready groups (oldest first), minus stale members.

        Returns:
            (groups to train, drops, lag of every sample examined in versions).
        """
        now = self.clock()
        ready = sorted(
            (g for g in self.pending.values() if self._is_ready(g, now)),
            key=lambda g: g.first_seen_s,
        )[:max_groups]
        groups, drops, lags = [], [], []
        for group in ready:
            del self.pending[group.group_id]
            self._release(group.entries)
            fresh = []
            for entry in group.entries:
                lag = sample_lag(entry.sample, trainer_version)
                lags.append(lag)
                if lag > max_staleness:
                    drops.append(Drop(entry, DropReason.STALE, f"lag {lag} > {max_staleness}"))
                else:
                    fresh.append(entry)
            if len(fresh) >= 2:
                groups.append(Group(group.group_id, group.first_seen_s, fresh))
            else:
                drops.extend(Drop(e, DropReason.SINGLETON, group.group_id) for e in fresh)
        return groups, drops, lags

    def held_entry_ids(self) -> list[str]:
        """Entries admitted and not yet handed out (still pending in Redis)."""
        return list(self._held_ids)

    def mark_trained(self, sample_ids: Iterable[str]) -> None:
        """Remember trained sample_ids (bounded) so re-published copies are dropped."""
        for sample_id in sample_ids:
            self._trained[sample_id] = None
            self._trained.move_to_end(sample_id)
        while len(self._trained) > self.remember:
            self._trained.popitem(last=False)

    def _release(self, entries: Iterable[StreamEntry]) -> None:
        for entry in entries:
            self._held_ids.discard(entry.entry_id)
            self._held_samples.discard(entry.sample.sample_id)
