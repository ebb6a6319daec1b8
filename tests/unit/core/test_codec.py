import pytest

from flywheel._proto import sample_pb2
from flywheel.core.codec import SCHEMA_MAJOR, decode_sample, encode_sample, new_sample
from flywheel.core.errors import ContractError


def _sample(**overrides):
    fields = {
        "token_ids": [1, 2, 3, 4],
        "loss_mask": [0, 0, 1, 1],
        "rollout_logprobs": [0.0, 0.0, -0.25, -1.5],
        "weight_versions": [-1, -1, 3, 3],
        "prompt_length": 2,
        "group_id": "g1",
    }
    fields.update(overrides)
    return new_sample(**fields)


def test_round_trip_keeps_every_field():
    sample = _sample(reward=0.5, has_reward=True, finish_reason="stop")
    sample.rewards["verifier"] = 1.0
    sample.messages.add(role="user", content_json='"hi"')
    decoded = decode_sample(encode_sample(sample))
    assert decoded == sample
    assert list(decoded.rollout_logprobs) == [0.0, 0.0, -0.25, -1.5]
    assert decoded.schema_version == SCHEMA_MAJOR
    assert len(decoded.sample_id) == 32


@pytest.mark.parametrize("field", ["loss_mask", "rollout_logprobs", "weight_versions"])
def test_length_mismatch_is_rejected_on_encode(field):
    sample = _sample()
    getattr(sample, field).append(0)
    with pytest.raises(ContractError, match=field):
        encode_sample(sample)


def test_length_mismatch_is_rejected_on_decode():
    bad = sample_pb2.Sample(
        schema_version=SCHEMA_MAJOR,
        token_ids=[1, 2],
        loss_mask=[1],
        rollout_logprobs=[0.0, 0.0],
        weight_versions=[0, 0],
    )
    with pytest.raises(ContractError, match="loss_mask"):
        decode_sample(bad.SerializeToString())


def test_unknown_schema_major_is_rejected():
    sample = _sample()
    sample.schema_version = SCHEMA_MAJOR + 1
    with pytest.raises(ContractError, match="schema major"):
        decode_sample(sample.SerializeToString())


def test_mask_values_and_teacher_alignment_checked():
    with pytest.raises(ContractError, match="0 or 1"):
        encode_sample(_sample(loss_mask=[0, 0, 2, 1]))
    with pytest.raises(ContractError, match="teacher_logprobs"):
        encode_sample(_sample(teacher_logprobs=[0.1]))
    with pytest.raises(ContractError, match="prompt_length"):
        encode_sample(_sample(prompt_length=9))


def test_garbage_bytes_are_a_contract_error():
    with pytest.raises(ContractError):
        decode_sample(b"\xff\xff\xff\x00not a sample")


@pytest.mark.parametrize("mask", [[0, 2], [-1, 1], [1, 1, 3]])
def test_a_loss_mask_value_other_than_0_or_1_is_rejected(mask):
    n = len(mask)
    bad = sample_pb2.Sample(
        schema_version=SCHEMA_MAJOR,
        token_ids=[1] * n,
        loss_mask=mask,
        rollout_logprobs=[0.0] * n,
        weight_versions=[0] * n,
    )
    with pytest.raises(ContractError, match="loss_mask values must be 0 or 1"):
        encode_sample(bad)
