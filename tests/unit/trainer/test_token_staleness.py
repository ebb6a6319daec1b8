"""Per-token staleness (staleness.py): tokens beyond the drop bound leave the loss, a sample with
none left is dropped, the rest is treated by its oldest token left; replay masks the same."""

from __future__ import annotations

from flywheel.core.codec import decode_sample, encode_sample
from flywheel.core.streams import StreamEntry
from flywheel.core.trainer_settings import StalenessSettings
from flywheel.trainer.commits import CommitRecord, GroupRecord
from flywheel.trainer.groups import DropReason, GroupAssembler
from flywheel.trainer.staleness import (
    STALE_TOKENS,
    StalenessPolicy,
    Treatment,
    mask_stale_tokens,
)

from .factories import make_sample


def _sample(versions, prompt_len=2, teacher=False):
    """A sample with `prompt_len` prompt tokens, then one sampled token per version."""
    n = prompt_len + len(versions)
    sample = make_sample(prompt_len=prompt_len, completion_len=len(versions), logprob=-0.5)
    for k, v in enumerate(versions):
        sample.weight_versions[prompt_len + k] = v
    if teacher:
        sample.teacher_logprobs.extend([0.0] * prompt_len + [-0.25] * len(versions))
        sample.teacher_mask.extend([0] * prompt_len + [1] * len(versions))
    assert len(sample.token_ids) == n
    return sample


def _policy(**kw):
    return StalenessPolicy(StalenessSettings(**kw))


def test_worked_example_under_drop():
    # trainer 10, max_staleness 2: floor 10 - 2 = 8; versions [7, 7, 8, 9, 9] -> lags
    # [3, 3, 2, 1, 1]: two tokens masked, three kept, lag of the oldest kept 10 - 8 = 2
    s = _sample([7, 7, 8, 9, 9])
    t = _policy(max_staleness=2).tokens(s.weight_versions, s.loss_mask, 10)
    assert (t.floor, t.stale, t.kept, t.lag, t.oldest_lag) == (8, 2, 3, 2, 3)
    # versions [6, 7] -> lags [4, 3], both > 2: nothing left
    s = _sample([6, 7])
    t = _policy(max_staleness=2).tokens(s.weight_versions, s.loss_mask, 10)
    assert (t.stale, t.kept, t.lag, t.oldest_lag) == (2, 0, 0, 4)
    # a token without a version (-1) counts as version 0: lag 10 > 2
    s = _sample([-1, 9])
    assert _policy(max_staleness=2).tokens(s.weight_versions, s.loss_mask, 10).stale == 1


def test_other_policies_mask_only_beyond_hard_limit():
    s = _sample([6, 7, 8, 9])  # trainer 10: lags [4, 3, 2, 1]
    down = _policy(max_staleness=2, policy="downweight", decay=0.5, hard_limit=3)
    t = down.tokens(s.weight_versions, s.loss_mask, 10)
    # floor 10 - 3 = 7: the version-6 token goes; oldest kept lag 3 > 2 -> 0.5 ** (3 - 2)
    assert (t.floor, t.stale, t.lag) == (7, 1, 3)
    assert down.treat(t.lag) == (Treatment.DOWNWEIGHT, 0.5)
    no_limit = _policy(max_staleness=2, policy="is_correct")
    t = no_limit.tokens(s.weight_versions, s.loss_mask, 10)
    assert (t.floor, t.stale, t.lag) == (-1, 0, 4)  # no bound: nothing masked


def test_mask_stale_tokens_keeps_the_context_and_the_invariants():
    s = _sample([7, 8, 9], teacher=True)  # token 2 is version 7
    out = mask_stale_tokens(s, 8)
    assert list(out.token_ids) == list(s.token_ids)
    assert list(out.loss_mask) == [0, 0, 0, 1, 1]
    assert list(out.weight_versions) == [-1, -1, -1, 8, 9]
    assert list(out.rollout_logprobs) == [0.0, 0.0, 0.0, -0.5, -0.5]
    assert list(out.teacher_mask) == [0, 0, 0, 1, 1]
    assert list(out.teacher_logprobs) == [0.0, 0.0, 0.0, -0.25, -0.25]
    assert list(s.loss_mask) == [0, 0, 1, 1, 1]  # the original is untouched
    assert decode_sample(encode_sample(out)) == out  # still a valid Sample
    assert mask_stale_tokens(s, 7) is s  # nothing older than 7


def _entry(sample, n):
    return StreamEntry(f"{n}-0", encode_sample(sample), sample)


def test_assembler_masks_stale_tokens_and_drops_samples_with_none_left():
    asm = GroupAssembler(3, 10.0)
    mixed = _entry(_sample([7, 7, 8, 9, 9]), 1)  # 2 of 5 tokens too old
    fresh = _entry(_sample([9, 10]), 2)
    gone = _entry(_sample([6, 7]), 3)  # all too old
    for e in (mixed, fresh, gone):
        assert asm.add(e) is None
    before = STALE_TOKENS._value.get()
    groups, drops, lags = asm.pop_ready(1, trainer_version=10, staleness=_policy(max_staleness=2))
    (group,) = groups
    assert [e.entry_id for e in group.entries] == [mixed.entry_id, fresh.entry_id]
    assert [(d.entry, d.reason) for d in drops] == [(gone, DropReason.STALE)]
    assert "all 2 sampled tokens lag > 2" in drops[0].detail
    assert lags == [3, 1, 4]  # oldest token of each examined sample
    assert group.lags == [2, 1] and group.version_floors == [8, -1]
    assert group.treatments == [(Treatment.FRESH, 1.0), (Treatment.FRESH, 1.0)]
    masked = group.entries[0]
    assert list(masked.sample.loss_mask) == [0, 0, 0, 0, 1, 1, 1]
    assert decode_sample(masked.payload) == masked.sample  # every rank trains the same
    assert group.entries[1] is fresh
    assert STALE_TOKENS._value.get() == before + 2  # the dropped sample counts as a drop


def test_replay_masks_the_same_tokens():
    mixed = _entry(_sample([7, 7, 8, 9, 9]), 1)
    fresh = _entry(_sample([9, 10]), 2)
    record = CommitRecord(
        11,
        [GroupRecord("g0", ["1-0", "2-0"], [("fresh", 1.0)] * 2, [8, -1])],
        ["a", "b"],
    )
    again = CommitRecord.from_json(record.to_json())
    assert again.groups[0].version_floors == [8, -1]
    (group,), missing = again.groups_of([mixed, fresh])
    assert missing == [] and group.version_floors == [8, -1]
    assert list(group.entries[0].sample.loss_mask) == [0, 0, 0, 0, 1, 1, 1]
    assert group.entries[1] is fresh
    # a record from before per-token staleness masks nothing
    old = CommitRecord(11, [GroupRecord("g0", ["1-0"], [("fresh", 1.0)])], ["a"])
    (group,), _ = old.groups_of([mixed])
    assert group.entries[0] is mixed
