"""Samples from segments: the one place a Sample is built from recorded ids, once, when it is
published (session/turns.py `publish`, session/finish.py).

Samples come from segments in three shapes (all share `session_id` and `group_id`):

- episode mode: one Sample per segment, loss mask 1 on every token sampled in it;
- live mode: one Sample per assistant turn: the turn's exact prompt ids + its sampled ids, loss
  mask 1 only on that turn's tokens (earlier turns are context, mask 0);
- n > 1 choices of a turn that the client did not continue with: the segment so far + that
  choice's ids, loss mask 1 only on the choice.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from flywheel._proto import sample_pb2
from flywheel.core.codec import new_sample
from flywheel.gateway.recording.records import PendingTurn, Segment, SegmentSample, SessionRecord


def next_state_message(following: list[dict[str, Any]]) -> sample_pb2.Message | None:
    """`Sample.next_state` for the messages that followed a turn (None when there are none).

    role: the first following message's role. content_json: its content (JSON text) when one
    message followed; when several did (parallel tool results, a tool result then a user
    message), their text contents joined by a blank line. extra_json: the first message's other
    fields (e.g. tool_call_id) and, when several followed, all of them under "messages".
    """
    if not following:
        return None
    first = following[0]
    if len(following) == 1:
        content: Any = first.get("content")
    else:
        content = "\n\n".join(str(m.get("content") or "") for m in following)
    extra = {k: v for k, v in first.items() if k not in ("role", "content")}
    if len(following) > 1:
        extra["messages"] = following
    return sample_pb2.Message(
        role=first["role"],
        content_json=json.dumps(content),
        extra_json=json.dumps(extra) if extra else "",
    )


def add_messages(sample: sample_pb2.Sample, messages: list[dict[str, Any]]) -> None:
    """Append `messages` to `sample.messages` (content and the other keys as JSON)."""
    for m in messages:
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        sample.messages.add(
            role=m["role"],
            content_json=json.dumps(m.get("content")),
            extra_json=json.dumps(extra) if extra else "",
        )


def add_conversation(
    sample: sample_pb2.Sample, seg: Segment, start: int, tokens: int, messages: int
) -> None:
    """Append `seg`'s first `tokens` tokens and first `messages` messages to `sample`; mask,
    logprobs, weight versions and renormalised-logprob marks only from token `start` on
    (0 / 0.0 / -1 / 0 before it). `logprob_renormalized` stays empty when no token is marked.

    Example: spans [(5, 9)], start 7, tokens 10 -> logprob_renormalized 1 at 7 and 8 only.
    """
    sample.token_ids.extend(seg.token_ids[:tokens])
    sample.loss_mask.extend([0] * start + seg.loss_mask[start:tokens])
    sample.rollout_logprobs.extend([0.0] * start + seg.logprobs[start:tokens])
    sample.weight_versions.extend([-1] * start + seg.versions[start:tokens])
    marks = [0] * tokens
    for a, b in seg.renormalized:
        for position in range(max(a, start), min(b, tokens)):
            marks[position] = 1
    if any(marks):
        sample.logprob_renormalized.extend(marks)
    add_messages(sample, seg.messages[:messages])


def sample_id(session_id: str, key: str) -> str:
    """A Sample's id: uuid5 of `<session_id>/<key>` (hex), deterministic, so a re-publish is a
    duplicate consumers can drop."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{session_id}/{key}").hex


def _new(
    record: SessionRecord,
    seg: Segment,
    key: str,
    turn_index: int,
    prompt_length: int,
    finish_reason: str,
    tools: list[dict[str, Any]] | None,
    sampling: dict[str, Any],
    created_at: float | None = None,
) -> sample_pb2.Sample:
    sample = new_sample(
        sample_id=sample_id(record.session_id, key),
        session_id=record.session_id,
        group_id=record.group_id,
        mode=record.mode,
        segment_index=seg.index,
        turn_index=turn_index,
        prompt_length=prompt_length,
        finish_reason=finish_reason,
        task_json=json.dumps(record.task),
        tools_json=json.dumps(tools) if tools else "",
        tenant=record.owner,
    )
    if created_at is not None:
        sample.created_at = created_at
    if sampling:
        sample.sampling.temperature = sampling["temperature"]
        sample.sampling.top_p = sampling["top_p"]
        sample.sampling.top_k = int(sampling["top_k"])
        sample.sampling.min_p = sampling["min_p"]
        sample.sampling.max_new_tokens = int(sampling["max_new_tokens"])
        sample.sampling.stop.extend(sampling.get("stop", []))
        if "seed" in sampling:
            sample.sampling.has_seed = True
            sample.sampling.seed = sampling["seed"]
    return sample


def build_sample(
    record: SessionRecord,
    seg: Segment,
    reward: float | None = None,
    *,
    turn_only: bool = False,
    sample_key: str = "",
    turn_index: int | None = None,
    created_at: float | None = None,
) -> sample_pb2.Sample:
    """The Sample of one segment (validated by the codec when it is encoded at publish).

    Args:
        record: the session.
        seg: the segment; with `turn_only` only its last turn is trainable (mask, logprobs and
            versions are cleared before `seg.turn_start`).
        reward: an outcome reward, stored as `rewards["outcome"]`.
        sample_key: what makes the sample id unique in the session (default: the segment).
        turn_index: the session-wide turn index (default: the segment's last turn).
        created_at: when the Sample became due (Unix seconds; default: now).
    """
    start = seg.turn_start if turn_only else 0
    sample = _new(
        record,
        seg,
        sample_key or str(seg.index),
        max(seg.turns - 1, 0) if turn_index is None else turn_index,
        start if turn_only else seg.prompt_length,
        seg.finish_reason,
        seg.tools,
        seg.sampling,
        created_at,
    )
    add_conversation(sample, seg, start, len(seg.token_ids), len(seg.messages))
    if reward is not None:
        sample.rewards["outcome"] = reward
    return sample


def segment_sample(record: SessionRecord, due: SegmentSample) -> sample_pb2.Sample:
    """The Sample of a `SegmentSample` (built once, when it is published)."""
    return build_sample(
        record,
        due.segment,
        turn_only=due.turn_only,
        sample_key=due.key,
        turn_index=due.turn_index,
        created_at=due.created_at,
    )


def turn_sample(
    record: SessionRecord,
    seg: Segment,
    turn: PendingTurn,
    following: list[dict[str, Any]] | None = None,
) -> sample_pb2.Sample:
    """The whole Sample of a waiting live turn of `seg`: the segment cut at the turn's
    checkpoint (ids, masks, logprobs, versions and messages as they were right after it), loss
    mask only from the turn's first sampled token, the turn's posted rewards and, when messages
    `following` it are given, its `next_state`.

    Raises:
        ValueError: `seg` has no checkpoint of that turn (it is not the turn's segment).
    """
    k = turn.checkpoint
    if not 0 <= k < len(seg.checkpoints):
        raise ValueError(
            f"pending turn at checkpoint {k} of a segment with {len(seg.checkpoints)} checkpoints"
        )
    sample = _new(
        record,
        seg,
        turn.key,
        turn.turn_index,
        turn.start,
        seg.finish_reason,
        seg.tools,
        seg.sampling,
        turn.created_at,
    )
    cp = seg.checkpoints[k]
    add_conversation(sample, seg, turn.start, cp.tokens, cp.messages)
    for name, value in turn.rewards.items():
        sample.rewards[name] = value
    message = next_state_message(following or [])
    if message is not None:
        sample.next_state.CopyFrom(message)
    return sample
