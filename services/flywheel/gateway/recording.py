"""Token-faithful recording of turns into a session's segment, and Samples from segments.

Rule (DESIGN.md section 5): a request extends the recorded segment when its messages start with
the recorded conversation (the assistant replies as produced here). Then the prompt is the
recorded ids followed by the template's rendering of only the new messages. Otherwise the
segment is closed (published as its own Sample) and a new one starts from a fresh rendering.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from prometheus_client import Counter

from flywheel._proto import sample_pb2
from flywheel.core.codec import new_sample
from flywheel.gateway.engine_pool import Generation
from flywheel.gateway.sessions import Segment, SessionRecord
from flywheel.gateway.tokenization import ChatRenderer

log = logging.getLogger(__name__)
FORKS = Counter("flywheel_gateway_segment_forks_total", "Requests that did not extend history")


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("role", "content", "tool_calls", "tool_call_id", "name")
    return all((a.get(k) or None) == (b.get(k) or None) for k in keys)


def extends(recorded: list[dict[str, Any]], messages: list[dict[str, Any]]) -> bool:
    """True when `messages` begins with every recorded message and adds at least one."""
    if len(messages) <= len(recorded):
        return False
    return all(_same_message(r, m) for r, m in zip(recorded, messages, strict=False))


def prepare_prompt(
    record: SessionRecord,
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> tuple[list[int], Segment | None]:
    """Input ids for the next turn; updates `record.segment` in place.

    Returns:
        (prompt ids to send to the engine, the closed segment if the request forked history
        and the old segment holds sampled tokens, else None).
    """
    seg = record.segment
    closed: Segment | None = None
    if seg.turns and extends(seg.messages, messages):
        ext = renderer.extend(seg.messages, messages, tools, ended_with_eos=seg.ended_with_eos)
        if ext is not None:
            seg.append(ext.suffix_ids, sampled=False)
            seg.messages = messages
            seg.tools = tools
            return list(seg.token_ids), None
    if seg.turns:
        FORKS.inc()
        record.forks += 1
        log.info("session %s: request does not extend segment %d; starting a new segment",
                 record.session_id, seg.index)
        closed = seg if seg.sampled_tokens else None
        seg = Segment(index=seg.index + 1)
        record.segment = seg
    ids = renderer.prompt_ids(messages, tools)
    seg.append(ids, sampled=False)
    seg.prompt_length = len(ids)
    seg.messages = messages
    seg.tools = tools
    return list(seg.token_ids), closed


def record_generation(
    record: SessionRecord, gen: Generation, sampling: dict[str, Any], reply: dict[str, Any]
) -> None:
    """Append the engine's sampled ids, logprobs and weight version, and the reply message."""
    seg = record.segment
    seg.append(
        gen.output_ids,
        sampled=True,
        logprobs=gen.output_logprobs,
        versions=[gen.weight_version] * len(gen.output_ids),
    )
    seg.messages = [*seg.messages, reply]
    seg.turns += 1
    seg.finish_reason = gen.finish_type
    seg.ended_with_eos = gen.matched_eos
    seg.sampling = {k: float(sampling[k]) for k in ("temperature", "top_p", "top_k", "min_p")}
    seg.sampling["max_new_tokens"] = float(sampling["max_new_tokens"])


def build_sample(
    record: SessionRecord, seg: Segment, reward: float | None = None
) -> sample_pb2.Sample:
    """The Sample of one segment (validated later by the codec on publish)."""
    sample = new_sample(
        # Deterministic per segment, so a re-publish is a duplicate consumers can drop.
        sample_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{record.session_id}/{seg.index}").hex,
        session_id=record.session_id,
        group_id=record.group_id,
        mode=record.mode,
        segment_index=seg.index,
        turn_index=max(seg.turns - 1, 0),
        token_ids=seg.token_ids,
        loss_mask=seg.loss_mask,
        rollout_logprobs=seg.logprobs,
        weight_versions=seg.versions,
        prompt_length=seg.prompt_length,
        finish_reason=seg.finish_reason,
        task_json=json.dumps(record.task),
        tools_json=json.dumps(seg.tools) if seg.tools else "",
        tenant=record.owner,
    )
    s = seg.sampling
    if s:
        sample.sampling.temperature = s["temperature"]
        sample.sampling.top_p = s["top_p"]
        sample.sampling.top_k = int(s["top_k"])
        sample.sampling.min_p = s["min_p"]
        sample.sampling.max_new_tokens = int(s["max_new_tokens"])
    for m in seg.messages:
        extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        sample.messages.add(role=m["role"], content_json=json.dumps(m.get("content")),
                            extra_json=json.dumps(extra) if extra else "")
    if reward is not None:
        sample.rewards["outcome"] = reward
    return sample
