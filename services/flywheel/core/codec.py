"""The Sample codec: protobuf bytes <-> `flywheel.v1.Sample`, with the length invariants checked.

Every Sample that enters or leaves a stream goes through `encode_sample` / `decode_sample`, so a
Sample whose per-token arrays disagree in length never travels (docs/sample.md).
"""

from __future__ import annotations

import time
import uuid

from google.protobuf.message import DecodeError

from flywheel._proto import sample_pb2
from flywheel.core.errors import ContractError

Sample = sample_pb2.Sample
SCHEMA_MAJOR = 1
"""Major version written into every Sample; decoders reject any other major."""


def new_sample(**fields: object) -> sample_pb2.Sample:
    """A Sample with a fresh uuid `sample_id`, `created_at` = now and the current schema version."""
    sample = sample_pb2.Sample(**fields)  # type: ignore[arg-type]  # protobuf kwargs are dynamic
    sample.schema_version = SCHEMA_MAJOR
    if not sample.sample_id:
        sample.sample_id = uuid.uuid4().hex
    if not sample.created_at:
        sample.created_at = time.time()
    return sample


def validate_sample(sample: sample_pb2.Sample) -> None:
    """Check the Sample invariants.

    Raises:
        ContractError: wrong schema major; per-token arrays of different lengths; a loss-mask
            or `logprob_renormalized` value other than 0/1; `prompt_length` beyond the tokens;
            teacher arrays or `logprob_renormalized` misaligned.
    """
    if sample.schema_version != SCHEMA_MAJOR:
        raise ContractError(
            f"Sample {sample.sample_id!r} has schema major {sample.schema_version}; this build "
            f"reads {SCHEMA_MAJOR}. Upgrade the consumer or re-publish with a matching producer."
        )
    n = len(sample.token_ids)
    lengths = {
        "loss_mask": len(sample.loss_mask),
        "rollout_logprobs": len(sample.rollout_logprobs),
        "weight_versions": len(sample.weight_versions),
    }
    bad = {name: length for name, length in lengths.items() if length != n}
    if bad:
        raise ContractError(
            f"Sample {sample.sample_id!r}: token_ids has {n} entries but {bad}; every per-token "
            "array must have len(token_ids) entries."
        )
    if not set(sample.loss_mask) <= {0, 1}:
        raise ContractError(f"Sample {sample.sample_id!r}: loss_mask values must be 0 or 1.")
    if sample.prompt_length > n:
        raise ContractError(
            f"Sample {sample.sample_id!r}: prompt_length {sample.prompt_length} > {n} tokens."
        )
    for name in ("teacher_logprobs", "teacher_mask", "wrong_hint_logprobs", "logprob_renormalized"):
        length = len(getattr(sample, name))
        if length not in (0, n):
            raise ContractError(
                f"Sample {sample.sample_id!r}: {name} has {length} entries; expected 0 or {n}."
            )
    if not set(sample.logprob_renormalized) <= {0, 1}:
        raise ContractError(
            f"Sample {sample.sample_id!r}: logprob_renormalized values must be 0 or 1."
        )
    k = sample.teacher_topk
    for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
        length = len(getattr(sample, name))
        if length not in (0, k * n):
            raise ContractError(
                f"Sample {sample.sample_id!r}: {name} has {length} entries; expected 0 or "
                f"teacher_topk * len(token_ids) = {k * n}."
            )


def encode_sample(sample: sample_pb2.Sample) -> bytes:
    """Serialize a Sample after validating it.

    Raises:
        ContractError: the Sample violates an invariant (see `validate_sample`).
    """
    validate_sample(sample)
    return sample.SerializeToString(deterministic=True)


def decode_sample(payload: bytes) -> sample_pb2.Sample:
    """Parse and validate a serialized Sample.

    Raises:
        ContractError: the bytes are not a Sample, or the Sample violates an invariant.
    """
    sample = sample_pb2.Sample()
    try:
        sample.ParseFromString(payload)
    except DecodeError as exc:
        raise ContractError(f"payload is not a serialized flywheel.v1.Sample: {exc}") from exc
    validate_sample(sample)
    return sample
