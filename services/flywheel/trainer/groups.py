"""Group assembly, admission and staleness control for the trainer's input stream.

Samples of one prompt share a `group_id`; group baselines (GRPO, RLOO) need the group together.
`GroupAssembler` is pure bookkeeping (no Redis, no torch): the service feeds it stream entries and
acts on what it returns (train the groups, ack or dead-letter the drops). Every drop carries a
reason, which the service counts and logs: data loss is never silent.

Policy:
- A group is ready when it has `group_size` samples, or when its first sample has waited
  `group_wait_s` (a partial group). A step starts when the ready groups hold
  `groups_per_step * group_size` samples (or `step_tokens` tokens, when set), or earlier when any
  ready group has waited `group_wait_s` (then with the ready groups there are).
- Partial groups (`partial_groups`): `train` trains a partial group if it has at least
  `min_group_size` fresh members, else drops them as `partial_group_singleton` (a lone sample has
  no group baseline: its advantage would be 0); `drop` drops every partial group as
  `partial_group` (acked).
- Live mode (`live_samples`): a sample without a `group_id` is its own group, ready at once; it
  gets a per-sample advantage in the step (its judge reward, or OPD token gaps). When live
  samples are off they are dropped as `no_group_id` (acked).
- Admission drops (on arrival): `no_reward` (has_reward false: scoring failed; dead-lettered with
  the scorer's error, so it can be inspected and replayed; two exceptions are admitted: with
  `keep_unjudged`, a sample the judge could not judge that has other reward components
  (`samples.keepable_unjudged`), and with `live_opd`, a group-less sample with teacher logprobs,
  whose OPD advantage needs no reward), `invalid` (breaks a per-token
  invariant; dead-lettered), `truncated_sampling` (top_p < 1, top_k > 0 or min_p > 0 and not
  allowed: BUG-08; acked), `duplicate` (a sample_id already held or recently trained; acked).
- Step drops: `nonfinite_step` (the step that used the sample had a non-finite loss or gradient
  norm and was skipped; dead-lettered), `no_loss_tokens` (the whole step had no sampled token
  to train; acked).
  A re-delivery of an entry already held is ignored (the held copy is acked after training).
- Staleness, per token, at the time a group is taken for a step (staleness.py): a sampled
  token's lag = trainer version - the weight version that sampled it (staleness is measured from
  dispatch, BUG-19; a token without a version, < 0, counts as version 0). Tokens beyond the drop
  bound (`max_staleness` under policy drop, else `hard_limit`) are masked out of the loss
  (counted, logged; the member's entry then holds the masked Sample and its re-encoded payload,
  and the group its version floor); a sample with no sampled token left is dropped as `stale`
  (acked). The rest is down-weighted or IS-corrected by the lag of its oldest token left, by the
  `StalenessPolicy`; the group keeps each member's lag and treatment.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from flywheel._proto import sample_pb2
from flywheel.core.codec import encode_sample
from flywheel.core.errors import ContractError
from flywheel.core.streams import StreamEntry
from flywheel.core.trainer_settings import StalenessSettings
from flywheel.trainer.samples import (
    check_trainable,
    keepable_unjudged,
    truncated_sampling,
)
from flywheel.trainer.staleness import (
    STALE_TOKENS,
    StalenessPolicy,
    Treatment,
    mask_stale_tokens,
)

log = logging.getLogger(__name__)
LIVE_PREFIX = "live/"
"""Internal group key prefix of a group-less (live-mode) sample: `live/<sample_id>`."""


class DropReason(StrEnum):
    NO_REWARD = "no_reward"
    INVALID = "invalid"
    NO_GROUP_ID = "no_group_id"
    TRUNCATED_SAMPLING = "truncated_sampling"
    DUPLICATE = "duplicate"
    STALE = "stale"
    SINGLETON = "partial_group_singleton"
    PARTIAL_GROUP = "partial_group"
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
    lags: list[int] = field(default_factory=list)
    """Lag (versions) of each entry when the group was taken for a step; [] before."""
    treatments: list[tuple[Treatment, float]] = field(default_factory=list)
    """Staleness treatment and loss weight of each entry (aligned with `entries`)."""
    version_floors: list[int] = field(default_factory=list)
    """Oldest weight version trained of each entry (aligned with `entries`; -1 = no token
    masked as stale; [] before the group is taken)."""

    @property
    def samples(self) -> list[sample_pb2.Sample]:
        return [e.sample for e in self.entries]

    @property
    def live(self) -> bool:
        """A group-less (live-mode) sample on its own."""
        return self.group_id.startswith(LIVE_PREFIX)

    @property
    def tokens(self) -> int:
        return sum(len(e.sample.token_ids) for e in self.entries)


class GroupAssembler:
    """Collects admitted entries by group_id and hands out ready groups.

    Args:
        group_size: members that make a group complete.
        group_wait_s: seconds after its first member that a partial group becomes ready.
        allow_truncated_sampling: admit top-p/top-k/min-p samples (see module docstring).
        live_samples: admit group-less samples as their own groups (else drop `no_group_id`).
        partial_groups: `train` or `drop` partial groups (see module docstring).
        min_group_size: fresh members a partial group needs to train (>= 1).
        clock: monotonic seconds (injected by tests).
        remember: trained sample_ids remembered to reject duplicates.
        keep_unjudged: admit unjudged samples that have other reward components
            (`trainer.data.unjudged = "keep"`).
        live_opd: admit group-less samples with teacher logprobs without a reward
            (`trainer.algorithm.live_advantage = "opd"` or `"opd_plus_rl"`).
        vocab_size: rows of the policy's embedding: a Sample with a token id outside
            [0, vocab_size) is dropped as invalid (None: not checked).
    """

    def __init__(
        self,
        group_size: int,
        group_wait_s: float,
        *,
        allow_truncated_sampling: bool = False,
        live_samples: bool = False,
        partial_groups: str = "train",
        min_group_size: int = 2,
        clock: Callable[[], float] = time.monotonic,
        remember: int = 100_000,
        keep_unjudged: bool = False,
        live_opd: bool = False,
        vocab_size: int | None = None,
    ):
        if partial_groups not in ("train", "drop"):
            raise ValueError(f"partial_groups must be 'train' or 'drop', got {partial_groups!r}")
        self.group_size = group_size
        self.group_wait_s = group_wait_s
        self.allow_truncated_sampling = allow_truncated_sampling
        self.live_samples = live_samples
        self.partial_groups = partial_groups
        self.min_group_size = max(min_group_size, 1)
        self.clock = clock
        self.remember = remember
        self.keep_unjudged = keep_unjudged
        self.live_opd = live_opd
        self.vocab_size = vocab_size
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
        key = sample.group_id or f"{LIVE_PREFIX}{sample.sample_id}"
        group = self.pending.get(key)
        if group is None:
            group = self.pending[key] = Group(key, self.clock())
        group.entries.append(entry)
        self._held_ids.add(entry.entry_id)
        self._held_samples.add(sample.sample_id)
        return None

    def _admission_drop(self, entry: StreamEntry) -> Drop | None:
        sample = entry.sample
        if not sample.has_reward and not self._admitted_without_reward(sample):
            return Drop(entry, DropReason.NO_REWARD, sample.error or "has_reward is false")
        try:
            check_trainable(sample, self.vocab_size)
        except ContractError as exc:
            return Drop(entry, DropReason.INVALID, str(exc))
        if not sample.group_id and not self.live_samples:
            return Drop(entry, DropReason.NO_GROUP_ID)
        if truncated_sampling(sample) and not self.allow_truncated_sampling:
            s = sample.sampling
            detail = f"top_p={s.top_p:g} top_k={s.top_k} min_p={s.min_p:g}"
            return Drop(entry, DropReason.TRUNCATED_SAMPLING, detail)
        if sample.sample_id in self._held_samples or sample.sample_id in self._trained:
            return Drop(entry, DropReason.DUPLICATE, f"sample_id {sample.sample_id}")
        return None

    def _admitted_without_reward(self, sample) -> bool:
        if self.keep_unjudged and keepable_unjudged(sample):
            return True
        return (
            self.live_opd and self.live_samples and not sample.group_id and any(sample.teacher_mask)
        )

    def _is_ready(self, group: Group, now: float) -> bool:
        return group.live or len(group.entries) >= self.group_size or self._overdue(group, now)

    def _overdue(self, group: Group, now: float) -> bool:
        return now - group.first_seen_s >= self.group_wait_s

    def _ready(self, now: float) -> list[Group]:
        """Ready groups, oldest first."""
        ready = (g for g in self.pending.values() if self._is_ready(g, now))
        return sorted(ready, key=lambda g: g.first_seen_s)

    def ready_count(self) -> int:
        return len(self._ready(self.clock()))

    def should_step(self, groups_per_step: int, step_tokens: int = 0) -> bool:
        """Ready groups hold `groups_per_step * group_size` samples (or `step_tokens` tokens when
        > 0), or a ready group has waited `group_wait_s`."""
        now = self.clock()
        ready = self._ready(now)
        samples = sum(len(g.entries) for g in ready)
        tokens = sum(g.tokens for g in ready) if step_tokens else 0
        return (
            samples >= groups_per_step * self.group_size
            or (step_tokens > 0 and tokens >= step_tokens)
            or any(self._overdue(g, now) for g in ready)
        )

    def pop_ready(
        self,
        max_groups: int,
        trainer_version: int,
        staleness: StalenessPolicy | int,
        step_tokens: int = 0,
    ) -> tuple[list[Group], list[Drop], list[int]]:
        """Take ready groups (oldest first) up to `max_groups * group_size` samples and, when
        `step_tokens` > 0, up to that many tokens (at least one group), minus stale members.

        Args:
            staleness: the policy, or just `max_staleness` (mode drop).

        Returns:
            (groups to train with their members' lags and treatments, drops, lag of every
            sample examined in versions).
        """
        policy = (
            staleness
            if isinstance(staleness, StalenessPolicy)
            else StalenessPolicy(StalenessSettings(max_staleness=staleness))
        )
        taken: list[Group] = []
        samples, tokens = 0, 0
        for group in self._ready(self.clock()):
            if taken and (
                samples + len(group.entries) > max_groups * self.group_size
                or (step_tokens > 0 and tokens + group.tokens > step_tokens)
            ):
                break
            taken.append(group)
            samples += len(group.entries)
            tokens += group.tokens
        groups: list[Group] = []
        drops: list[Drop] = []
        lags: list[int] = []
        for group in taken:
            del self.pending[group.group_id]
            self._release(group.entries)
            kept = self._examine(group, trainer_version, policy, drops, lags)
            partial = not group.live and len(group.entries) < self.group_size
            if partial and self.partial_groups == "drop":
                detail = f"{group.group_id}: {len(group.entries)} of {self.group_size}"
                drops.extend(Drop(e, DropReason.PARTIAL_GROUP, detail) for e in kept.entries)
            elif group.live or len(kept.entries) >= min(self.min_group_size, self.group_size):
                groups.append(kept)
            else:
                drops.extend(Drop(e, DropReason.SINGLETON, group.group_id) for e in kept.entries)
        return groups, drops, lags

    @staticmethod
    def _examine(
        group: Group, version: int, policy: StalenessPolicy, drops: list[Drop], lags: list[int]
    ) -> Group:
        """The group's members that are not dropped as stale, with their lags and treatments;
        a member with tokens beyond the drop bound keeps only its fresher tokens in the loss
        (staleness.py; counted and logged)."""
        kept = Group(group.group_id, group.first_seen_s)
        for entry in group.entries:
            tokens = policy.tokens(entry.sample.weight_versions, entry.sample.loss_mask, version)
            lags.append(tokens.oldest_lag)
            if tokens.stale and not tokens.kept:
                detail = f"all {tokens.stale} sampled tokens lag > {policy.drop_bound}"
                drops.append(Drop(entry, DropReason.STALE, detail))
                continue
            treatment, weight = policy.treat(tokens.lag)
            if treatment == Treatment.DROP:
                detail = f"lag {tokens.lag} > {policy.max_staleness}"
                drops.append(Drop(entry, DropReason.STALE, detail))
                continue
            if tokens.stale:
                entry = masked_entry(entry, tokens.floor)
                STALE_TOKENS.inc(tokens.stale)
                log.info(
                    "sample %s: %d of %d sampled tokens lag > %s versions, out of the loss",
                    entry.sample.sample_id,
                    tokens.stale,
                    tokens.stale + tokens.kept,
                    policy.drop_bound,
                )
            kept.entries.append(entry)
            kept.lags.append(tokens.lag)
            kept.treatments.append((treatment, weight))
            kept.version_floors.append(tokens.floor if tokens.stale else -1)
        return kept

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


def masked_entry(entry: StreamEntry, floor: int) -> StreamEntry:
    """`entry` with its sampled tokens of versions below `floor` out of the loss
    (`staleness.mask_stale_tokens`), its payload re-encoded so every rank trains the same
    Sample; `entry` itself when `floor` < 0 or nothing is masked."""
    if floor < 0:
        return entry
    sample = mask_stale_tokens(entry.sample, floor)
    if sample is entry.sample:
        return entry
    return StreamEntry(entry.entry_id, encode_sample(sample), sample)
