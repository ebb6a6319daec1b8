"""Sample sources: dump record/replay round trips, replay positions, fake groups, recording."""

from __future__ import annotations

import pytest

from flywheel.core.errors import ContractError
from flywheel.core.trainer_settings import StalenessSettings
from flywheel.trainer.samples import check_trainable
from flywheel.trainer.sources import FakeSource, RecordingSource, ReplaySource, SampleDump
from flywheel.trainer.staleness import StalenessPolicy, Treatment

from .factories import make_sample


@pytest.mark.parametrize("suffix", [".jsonl", ".bin"])
def test_dump_round_trips_samples_exactly(tmp_path, suffix):
    samples = [make_sample(seed=i, reward=0.35 * i, logprob=-0.123456789) for i in range(3)]
    dump = SampleDump(tmp_path / f"d{suffix}")
    dump.append(samples[:2])
    dump.append(samples[2:])
    source = ReplaySource(dump.path)
    entries = source.read(10, block_ms=0)
    assert [e.entry_id for e in entries] == ["1-0", "2-0", "3-0"]
    assert [e.sample for e in entries] == samples  # protobuf equality: every field, bit-exact
    assert source.exhausted and source.read(10, block_ms=0) == []


def test_dump_rejects_other_suffixes_and_truncated_records(tmp_path):
    with pytest.raises(ValueError, match=".jsonl or .bin"):
        SampleDump(tmp_path / "d.txt")
    dump = SampleDump(tmp_path / "d.bin")
    dump.append([make_sample()])
    dump.path.write_bytes(dump.path.read_bytes()[:-3])
    with pytest.raises(ContractError, match="truncated"):
        ReplaySource(dump.path)


def test_replay_position_skips_what_was_done(tmp_path):
    dump = SampleDump(tmp_path / "d.jsonl")
    dump.append([make_sample(seed=i) for i in range(5)])
    source = ReplaySource(dump.path)
    first = source.read(3, block_ms=0)
    source.ack(["1-0", "3-0"])  # 2 still in flight
    position = source.position()
    assert position["position"] == 2 and position["done"] == ["3-0"]
    assert first[1].entry_id == "2-0"
    # a resumed replay starts at 2, skips 3, and goes on with 4, 5
    resumed = ReplaySource(dump.path, position["position"], position["done"])
    assert [e.entry_id for e in resumed.read(10, block_ms=0)] == ["2-0", "4-0", "5-0"]


def test_fake_source_makes_trainable_groups_at_the_trainer_version():
    version = {"v": 3}
    source = FakeSource(
        vocab_size=50,
        group_size=4,
        prompt_tokens=5,
        completion_tokens=7,
        version=lambda: version["v"],
    )
    entries = source.read(8, block_ms=0)
    assert [e.sample.group_id for e in entries] == ["fake-0"] * 4 + ["fake-1"] * 4
    for entry in entries:
        check_trainable(entry.sample)
        assert len(entry.sample.token_ids) == 12 and sum(entry.sample.loss_mask) == 7
        assert max(entry.sample.token_ids) < 50 and entry.sample.has_reward
        assert set(entry.sample.weight_versions[5:]) == {3}
    assert len({e.sample.sample_id for e in entries}) == 8


def test_recording_source_appends_what_it_hands_out(tmp_path):
    dump = SampleDump(tmp_path / "rec.bin")
    source = RecordingSource(FakeSource(50, 2, 3, 3), dump)
    handed = source.read(4, block_ms=0)
    assert [e.sample for e in ReplaySource(dump.path).read(10, block_ms=0)] == [
        e.sample for e in handed
    ]


def test_staleness_policy_worked_examples():
    # max_staleness 2, decay 0.5: lag 2 fresh; lag 4 -> 0.5 ** (4 - 2) = 0.25 when down-weighted
    def policy(name: str, **kw) -> StalenessPolicy:
        return StalenessPolicy(StalenessSettings(max_staleness=2, policy=name, **kw))

    assert policy("drop").treat(2) == (Treatment.FRESH, 1.0)
    assert policy("drop").treat(3) == (Treatment.DROP, 0.0)
    assert policy("downweight", decay=0.5).treat(4) == (Treatment.DOWNWEIGHT, 0.25)
    assert policy("is_correct").treat(9) == (Treatment.IS_CORRECT, 1.0)
    assert policy("is_correct", hard_limit=8).treat(9) == (Treatment.DROP, 0.0)
    with pytest.raises(ValueError):
        policy("sometimes")


def test_check_trainable_refuses_ids_outside_the_vocabulary_and_non_finite_rewards():
    ok = make_sample(prompt_len=3, completion_len=3)  # ids drawn below the factory's vocab
    check_trainable(ok, vocab_size=max(ok.token_ids) + 1)  # the largest id is in range
    with pytest.raises(ContractError, match=r"token id \d+ is outside .*\[0, \d+\)"):
        check_trainable(ok, vocab_size=max(ok.token_ids))  # ... and out of range one row less
    negative = make_sample()
    negative.token_ids[1] = -7
    with pytest.raises(ContractError, match="token id -7"):
        check_trainable(negative, vocab_size=50_000)
    check_trainable(negative)  # without a vocabulary size ids are not checked
    for name, value in (("reward", float("nan")), ("outcome", float("inf"))):
        bad = make_sample()
        if name == "reward":
            bad.reward = value
        else:
            bad.rewards[name] = value
        with pytest.raises(ContractError, match=f"{name}.* is {value}"):
            check_trainable(bad)


def test_gone_consumers_without_pending_entries_are_forgotten(redis_client, prefix):
    from flywheel.core.streams import StreamConsumer
    from flywheel.trainer.sources import CONSUMER_GROUP, RedisSource

    stream = f"{prefix}:train"
    redis_client.xadd(stream, {"x": "1"})
    redis_client.xgroup_create(stream, CONSUMER_GROUP, id="0")
    # an earlier trainer that holds nothing any more, and one that still holds an entry
    redis_client.xgroup_createconsumer(stream, CONSUMER_GROUP, "old-empty")
    redis_client.xreadgroup(CONSUMER_GROUP, "old-holding", {stream: ">"}, count=1)
    consumer = StreamConsumer(
        redis_client, stream, CONSUMER_GROUP, "new", dead_stream=f"{prefix}:dead"
    )
    source = RedisSource(consumer)
    assert source.forget_gone_consumers(idle_ms=10**9) == []  # not idle long enough
    assert source.forget_gone_consumers(idle_ms=0) == ["old-empty"]
    names = {c["name"] for c in redis_client.xinfo_consumers(stream, CONSUMER_GROUP)}
    assert {n.decode() if isinstance(n, bytes) else n for n in names} == {"old-holding"}
