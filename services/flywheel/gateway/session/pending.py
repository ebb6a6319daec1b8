"""A live turn waiting for its next state, as its session record keeps it.

The turn's Sample holds the whole conversation's ids, logprobs and messages up to the turn; kept
whole in the record, it would make every save of a long live session write the conversation
again. The record keeps the Sample without them (`SessionRecord.pending`, `Branch.pending`:
"<checkpoint>:<turn start>:<base64 Sample>") and takes them back from the turn's segment when
the Sample is published: the segment cut at the turn's checkpoint is exactly what it was right
after the turn (segments only grow; records.Segment.upto). A pending turn stored whole by an
earlier version (plain base64) still reads.
"""

from __future__ import annotations

import base64

from flywheel._proto import sample_pb2
from flywheel.gateway.recording.records import Segment
from flywheel.gateway.recording.sample import add_conversation

_FROM_SEGMENT = ("token_ids", "loss_mask", "rollout_logprobs", "weight_versions", "messages")
"""What the stored form leaves out and `restore` takes from the segment."""


def _b64(sample: sample_pb2.Sample) -> str:
    return base64.b64encode(sample.SerializeToString()).decode()


def _parse(b64: str) -> sample_pb2.Sample:
    sample = sample_pb2.Sample()
    sample.ParseFromString(base64.b64decode(b64))
    return sample


def stored(light: sample_pb2.Sample, seg: Segment) -> str:
    """The stored form of the Sample of `seg`'s latest turn, built right after it without its
    conversation (`light`: sample.build_sample with conversation=False).

    Raises:
        ValueError: `light` holds per-token lists or messages.
    """
    if any(len(getattr(light, name)) for name in _FROM_SEGMENT):
        raise ValueError("a pending turn is stored without its conversation")
    return f"{len(seg.checkpoints) - 1}:{seg.turn_start}:{_b64(light)}"


def restore(pending: str, seg: Segment) -> sample_pb2.Sample:
    """The whole Sample of a stored pending turn of `seg`.

    Raises:
        ValueError: `seg` has no checkpoint of that turn (it is not the turn's segment).
    """
    head, sep, b64 = pending.rpartition(":")
    if not sep:  # stored whole
        return _parse(pending)
    k, start = (int(x) for x in head.split(":"))
    if not 0 <= k < len(seg.checkpoints):
        raise ValueError(
            f"pending turn at checkpoint {k} of a segment with {len(seg.checkpoints)} checkpoints"
        )
    sample = _parse(b64)
    cp = seg.checkpoints[k]
    add_conversation(sample, seg, start, cp.tokens, cp.messages)
    return sample


def with_reward(pending: str, name: str, value: float) -> tuple[str, sample_pb2.Sample]:
    """`pending` with `rewards[name] = value` added, and its Sample as stored (without the
    segment's parts: `turn_index` and `rewards` are there)."""
    head, sep, b64 = pending.rpartition(":")
    sample = _parse(b64)
    sample.rewards[name] = value
    return f"{head}{sep}{_b64(sample)}", sample
