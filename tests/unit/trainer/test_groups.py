"""GroupAssembler: readiness, admission drops, partial groups, staleness."""

from __future__ import annotations

from flywheel.core.codec import encode_sample
from flywheel.core.streams import StreamEntry
from flywheel.core.trainer_settings import StalenessSettings
from flywheel.trainer.groups import DropReason, GroupAssembler
from flywheel.trainer.samples import sample_lag
from flywheel.trainer.staleness import StalenessPolicy, Treatment

from .factories import make_sample


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


_ids = iter(range(1, 10**6))


def entry(**kw) -> StreamEntry:
    sample = make_sample(**kw)
    return StreamEntry(f"{next(_ids)}-0", encode_sample(sample), sample)


def assembler(group_size=4, wait=10.0, **kw):
    clock = Clock()
    return GroupAssembler(group_size, wait, clock=clock, **kw), clock


def test_complete_group_is_ready_and_step_waits_for_groups_per_step():
    asm, _ = assembler(group_size=2)
    for group in ["a", "a", "b"]:
        assert asm.add(entry(group_id=group)) is None
    assert asm.ready_count() == 1
    assert not asm.should_step(groups_per_step=2)
    asm.add(entry(group_id="b"))
    assert asm.should_step(groups_per_step=2)
    groups, drops, lags = asm.pop_ready(2, trainer_version=0, staleness=4)
    assert sorted(g.group_id for g in groups) == ["a", "b"]
    assert drops == [] and lags == [0, 0, 0, 0]
    assert asm.pending == {} and asm.held_entry_ids() == []


def test_partial_group_becomes_ready_after_wait_and_trains_with_two_members():
    asm, clock = assembler(group_size=4, wait=10.0)
    asm.add(entry(group_id="a"))
    asm.add(entry(group_id="a"))
    assert not asm.should_step(groups_per_step=1)
    clock.now += 10.0
    assert asm.should_step(groups_per_step=4)  # an overdue group does not wait for 3 more
    groups, drops, _ = asm.pop_ready(4, 0, 4)
    assert [len(g.entries) for g in groups] == [2] and drops == []


def test_overdue_singleton_is_dropped():
    asm, clock = assembler(group_size=4, wait=10.0)
    lone = entry(group_id="a")
    asm.add(lone)
    clock.now += 11.0
    groups, drops, _ = asm.pop_ready(4, 0, 4)
    assert groups == []
    assert [(d.entry, d.reason) for d in drops] == [(lone, DropReason.SINGLETON)]
    assert not DropReason.SINGLETON.dead_letter


def test_admission_drops_with_reasons():
    asm, _ = assembler()
    no_reward = entry(has_reward=False, error="judge timed out")
    drop = asm.add(no_reward)
    assert drop.reason == DropReason.NO_REWARD and "judge timed out" in drop.detail
    assert drop.reason.dead_letter
    assert asm.add(entry(group_id="")).reason == DropReason.NO_GROUP_ID

    top_p = entry()
    top_p.sample.sampling.top_p = 0.8
    assert asm.add(top_p).reason == DropReason.TRUNCATED_SAMPLING
    top_k = entry()
    top_k.sample.sampling.top_k = 20
    assert asm.add(top_k).reason == DropReason.TRUNCATED_SAMPLING
    full = entry()
    full.sample.sampling.top_p, full.sample.sampling.top_k = 1.0, -1
    assert asm.add(full) is None

    bad = entry()
    bad.sample.loss_mask[0] = 1
    drop = asm.add(bad)
    assert drop.reason == DropReason.INVALID and drop.reason.dead_letter


def test_truncated_sampling_admitted_when_allowed():
    asm, _ = assembler(allow_truncated_sampling=True)
    top_p = entry()
    top_p.sample.sampling.top_p = 0.8
    assert asm.add(top_p) is None


def test_duplicates_and_redeliveries():
    asm, _ = assembler(group_size=2)
    first = entry(group_id="a", seed=1)
    assert asm.add(first) is None
    assert asm.add(first) is None  # the same entry re-delivered: ignored, still held once
    assert asm.held_entry_ids() == [first.entry_id]
    copy = StreamEntry("999999-0", first.payload, first.sample)  # re-published sample
    assert asm.add(copy).reason == DropReason.DUPLICATE
    asm.add(entry(group_id="a", seed=2))
    groups, _, _ = asm.pop_ready(1, 0, 4)
    asm.mark_trained(s.sample_id for s in groups[0].samples)
    assert asm.add(StreamEntry("999998-0", first.payload, first.sample)).reason == "duplicate"


def test_staleness_lag_from_the_oldest_sampled_token():
    sample = make_sample(prompt_len=2, completion_len=3, version=4)
    sample.weight_versions[3] = 2  # a sampled token from older weights
    assert sample_lag(sample, trainer_version=5) == 3
    sample.weight_versions[4] = -1  # unknown version counts as 0
    assert sample_lag(sample, trainer_version=5) == 5
    assert sample_lag(make_sample(completion_len=0), trainer_version=9) == 0


def test_stale_members_dropped_and_lags_reported():
    asm, _ = assembler(group_size=3)
    fresh1 = entry(group_id="a", version=3)  # lag 5 - 3 = 2 <= 2: kept
    fresh2 = entry(group_id="a", version=5)  # lag 0
    stale = entry(group_id="a", version=2)  # lag 3 > 2: dropped
    for e in (fresh1, fresh2, stale):
        asm.add(e)
    groups, drops, lags = asm.pop_ready(1, trainer_version=5, staleness=2)
    assert [e.entry_id for e in groups[0].entries] == [fresh1.entry_id, fresh2.entry_id]
    assert [(d.entry, d.reason) for d in drops] == [(stale, DropReason.STALE)]
    assert sorted(lags) == [0, 2, 3]


def test_group_left_with_one_fresh_member_is_dropped():
    asm, _ = assembler(group_size=2)
    asm.add(entry(group_id="a", version=0))
    asm.add(entry(group_id="a", version=9))
    groups, drops, _ = asm.pop_ready(1, trainer_version=9, staleness=1)
    assert groups == []
    assert sorted(d.reason for d in drops) == [DropReason.SINGLETON, DropReason.STALE]


def test_pop_ready_takes_oldest_groups_first():
    asm, clock = assembler(group_size=2)
    for name in ["late", "early"]:
        clock.now += 1
        asm.add(entry(group_id=name))
        asm.add(entry(group_id=name))
    asm.pending["early"].first_seen_s = 0.0
    groups, _, _ = asm.pop_ready(1, 0, 4)
    assert [g.group_id for g in groups] == ["early"]
    assert list(asm.pending) == ["late"]


def test_live_samples_are_their_own_ready_groups_when_enabled():
    asm, _ = assembler(group_size=4, live_samples=True)
    live = [entry(group_id="", seed=i) for i in range(2)]
    for e in live:
        assert asm.add(e) is None
    assert asm.ready_count() == 2
    assert not asm.should_step(groups_per_step=1)  # 2 samples < 1 x 4
    asm.add(entry(group_id="", seed=7))
    asm.add(entry(group_id="", seed=8))
    assert asm.should_step(groups_per_step=1)
    groups, drops, _ = asm.pop_ready(1, 0, 4)
    assert drops == [] and [len(g.entries) for g in groups] == [1, 1, 1, 1]
    assert all(g.live for g in groups)


def test_partial_groups_dropped_when_configured():
    asm, clock = assembler(group_size=4, wait=10.0, partial_groups="drop")
    members = [entry(group_id="a", seed=i) for i in range(3)]
    for e in members:
        asm.add(e)
    clock.now += 10.0
    groups, drops, _ = asm.pop_ready(4, 0, 4)
    assert groups == []
    assert [d.reason for d in drops] == [DropReason.PARTIAL_GROUP] * 3
    assert "3 of 4" in drops[0].detail and not DropReason.PARTIAL_GROUP.dead_letter


def test_token_budget_starts_and_bounds_a_step():
    # each sample has 4 + 4 = 8 tokens; a group of 2 holds 16
    asm, _ = assembler(group_size=2)
    for name in ["a", "a", "b", "b", "c", "c"]:
        asm.add(entry(group_id=name))
    assert not asm.should_step(groups_per_step=8)
    assert asm.should_step(groups_per_step=8, step_tokens=40)
    groups, _, _ = asm.pop_ready(8, 0, 4, step_tokens=40)
    assert [g.group_id for g in groups] == ["a", "b"]  # 32 tokens; a third group would be 48


def test_stale_members_down_weighted_or_is_corrected_by_policy():
    asm, _ = assembler(group_size=2)
    asm.add(entry(group_id="a", version=5))
    asm.add(entry(group_id="a", version=1))  # lag 4 > 2
    policy = StalenessPolicy(StalenessSettings(max_staleness=2, policy="downweight", decay=0.5))
    groups, drops, lags = asm.pop_ready(1, trainer_version=5, staleness=policy)
    assert drops == [] and lags == [0, 4]
    assert groups[0].treatments == [(Treatment.FRESH, 1.0), (Treatment.DOWNWEIGHT, 0.25)]


def test_unjudged_samples_with_other_components_are_kept_only_when_configured():
    # The judge failed (has_reward false, error "unjudged: ...") but an environment reward exists:
    # `keep` admits it (its reward is the weighted sum of the other components); `drop` does not.
    def unjudged(**kw):
        e = entry(
            has_reward=False, error="unjudged: judge infra/timeout (prm@v2, 0 of 3 votes)", **kw
        )
        e.sample.rewards["env"] = 1.0
        return e

    kept, _ = assembler(keep_unjudged=True)
    assert kept.add(unjudged(seed=1)) is None
    dropped, _ = assembler()
    assert dropped.add(unjudged(seed=1)).reason == DropReason.NO_REWARD
    # Only the judge's own per-step components ("step/0") are not a reward of their own.
    judge_only = entry(has_reward=False, error="unjudged: judge down", seed=2)
    judge_only.sample.rewards["step/0"] = 1.0
    assert kept.add(judge_only).reason == DropReason.NO_REWARD


def test_live_opd_samples_need_teacher_logprobs_not_a_reward():
    asm, _ = assembler(live_samples=True, live_opd=True)
    scored = entry(group_id="", has_reward=False, seed=3)
    n = len(scored.sample.token_ids)
    scored.sample.teacher_logprobs.extend([0.0] * 4 + [-0.5] * (n - 4))
    scored.sample.teacher_mask.extend([0] * 4 + [1] * (n - 4))
    assert asm.add(scored) is None
    unscored = entry(group_id="", has_reward=False, seed=4)
    assert asm.add(unscored).reason == DropReason.NO_REWARD
    # A grouped sample without a reward is still dropped: its group baseline needs the reward.
    grouped = entry(has_reward=False, seed=5)
    grouped.sample.teacher_logprobs.extend([-0.5] * n)
    grouped.sample.teacher_mask.extend([1] * n)
    assert asm.add(grouped).reason == DropReason.NO_REWARD
