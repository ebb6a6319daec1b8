"""Samples from segments: the one place a Sample is built from recorded ids.

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
from flywheel.gateway.recording.records import Segment, SessionRecord


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
    logprobs and weight versions only from token `start` on (0 / 0.0 / -1 before it)."""
    sample.token_ids.extend(seg.token_ids[:tokens])
    sample.loss_mask.extend([0] * start + seg.loss_mask[start:tokens])
    sample.rollout_logprobs.extend([0.0] * start + seg.logprobs[start:tokens])
    sample.weight_versions.extend([-1] * start + seg.versions[start:tokens])
    add_messages(sample, seg.messages[:messages])


def build_sample(
    record: SessionRecord,
    seg: Segment,
    reward: float | None = None,
    *,
    turn_only: bool = False,
    sample_key: str = "",
    turn_index: int | None = None,
    conversation: bool = True,
) -> sample_pb2.Sample:
    """The Sample of one segment (validated later by the codec on publish).

    Args:
        record: the session.
        seg: the segment; with `turn_only` only its last turn is trainable (mask, logprobs and
            versions are cleared before `seg.turn_start`).
        reward: an outcome reward, stored as `rewards["outcome"]`.
        sample_key: what makes the sample id unique in the session (default: the segment).
        turn_index: the session-wide turn index (default: the segment's last turn).
        conversation: False leaves out the per-token lists and the messages (what a pending
            live turn takes back from its segment when published, pending.py).
    """
    start = seg.turn_start if turn_only else 0
    sample = new_sample(
        # Deterministic, so a re-publish is a duplicate consumers can drop.
        sample_id=uuid.uuid5(
            uuid.NAMESPACE_URL, f"{record.session_id}/{sample_key or seg.index}"
        ).hex,
        session_id=record.session_id,
        group_id=record.group_id,
        mode=record.mode,
        segment_index=seg.index,
        turn_index=max(seg.turns - 1, 0) if turn_index is None else turn_index,
        prompt_length=start if turn_only else seg.prompt_length,
        finish_reason=seg.finish_reason,
        task_json=json.dumps(record.task),
        tools_json=json.dumps(seg.tools) if seg.tools else "",
        tenant=record.owner,
    )
    if conversation:
        add_conversation(sample, seg, start, len(seg.token_ids), len(seg.messages))
    s = seg.sampling
    if s:
        sample.sampling.temperature = s["temperature"]
        sample.sampling.top_p = s["top_p"]
        sample.sampling.top_k = int(s["top_k"])
        sample.sampling.min_p = s["min_p"]
        sample.sampling.max_new_tokens = int(s["max_new_tokens"])
        sample.sampling.stop.extend(s.get("stop", []))
        if "seed" in s:
            sample.sampling.has_seed = True
            sample.sampling.seed = s["seed"]
    if reward is not None:
        sample.rewards["outcome"] = reward
    return sample
