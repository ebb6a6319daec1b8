"""Token-faithful recording of turns into a session's segment (Samples: sample.py).

Rule (docs/token-path.md): a request extends the recorded segment when its messages start with
the recorded conversation (the assistant replies as produced here). Then the prompt is the
recorded ids followed by the template's rendering of only the new messages. Otherwise the
segment is closed and a new one starts from a fresh rendering; the fork is counted per reason
(`flywheel_gateway_segment_forks_total{reason}`, see `fork_reason`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.recording.records import SampledReply, Segment, SessionRecord
from flywheel.gateway.render.tokenization import ChatRenderer

log = logging.getLogger(__name__)
FORKS = Counter(
    "flywheel_gateway_segment_forks_total",
    "Requests that did not extend the recorded history (a new segment started)",
    ["reason"],
)
FORK_REASONS = (
    "tool_arguments_reformatted",
    "assistant_edited",
    "history_edited",
    "history_truncated",
    "regenerated",
    "template_rewrites_history",
    "sampling_changed",
)
"""Fork reasons, in the order `fork_reason` checks them (`sampling_changed`: an episode turn
sampled with another temperature, top_p, top_k or min_p than the segment's earlier turns; a
Sample carries one sampling setting, which the trainer recomputes logprobs with, BUG-07)."""
DISTRIBUTION_KEYS = ("temperature", "top_p", "top_k", "min_p")
"""Sampling params that change the distribution a token is drawn from (not max_new_tokens)."""
for _reason in FORK_REASONS:
    FORKS.labels(_reason)
_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _exact_same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all((a.get(k) or None) == (b.get(k) or None) for k in _KEYS)


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as a conversation turn: tool calls compare by name and parsed arguments (clients
    re-serialize argument JSON and may drop call ids; whether the template's rendering still
    matches is checked separately, on the rendered text)."""
    if a.get("tool_calls") or b.get("tool_calls"):
        keys = tuple(k for k in _KEYS if k != "tool_calls")
        return all((a.get(k) or None) == (b.get(k) or None) for k in keys) and _arguments(
            a.get("tool_calls")
        ) == _arguments(b.get("tool_calls"))
    return _exact_same(a, b)


def extends(recorded: list[dict[str, Any]], messages: list[dict[str, Any]]) -> bool:
    """True when `messages` begins with every recorded message and adds at least one."""
    if len(messages) <= len(recorded):
        return False
    return all(_same_message(r, m) for r, m in zip(recorded, messages, strict=False))


def _arguments(calls: list[dict[str, Any]] | None) -> list[Any]:
    out = []
    for call in calls or []:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "null")
        except (TypeError, json.JSONDecodeError):
            args = fn.get("arguments")
        out.append((fn.get("name"), args))
    return out


def fork_reason(recorded: list[dict[str, Any]], messages: list[dict[str, Any]]) -> str:
    """Why `messages` does not extend `recorded` as messages (one of `FORK_REASONS`).

    `template_rewrites_history` and `tool_arguments_reformatted` (same calls, but the template
    renders the re-serialized arguments differently) are decided on the rendered text
    (`prepare_prompt`), not here.
    """
    for r, m in zip(recorded, messages, strict=False):
        if _same_message(r, m):
            continue
        if r.get("role") == m.get("role") == "assistant":
            return "assistant_edited"
        return "history_edited"
    if recorded and len(messages) == len(recorded) - 1 and recorded[-1]["role"] == "assistant":
        return "regenerated"
    return "history_truncated"


def sampling_changed(record: SessionRecord, sampling: dict[str, Any] | None) -> bool:
    """True when an episode's next turn would be drawn from another distribution than the
    segment's earlier turns (a `DISTRIBUTION_KEYS` value differs), so it needs a new segment.
    Greedy turns (temperature 0 in both) take the argmax whatever top_p, top_k or min_p say,
    so they never differ."""
    seg = record.segment
    if not (record.mode == "episode" and sampling is not None and seg.turns and seg.sampling):
        return False
    if float(sampling["temperature"]) == 0.0 == seg.sampling.get("temperature"):
        return False
    return any(float(sampling[k]) != seg.sampling.get(k) for k in DISTRIBUTION_KEYS)


def count_fork(record: SessionRecord, reason: str) -> None:
    """Count a fork of `record` (metric, the record's totals, a log line)."""
    FORKS.labels(reason).inc()
    record.forks += 1
    record.fork_reasons[reason] = record.fork_reasons.get(reason, 0) + 1
    log.info(
        "session %s: request does not extend segment %d (%s); starting a new segment",
        record.session_id,
        record.segment.index,
        reason,
    )


def prepare_prompt(
    record: SessionRecord,
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    sampling: dict[str, Any] | None = None,
) -> tuple[list[int], Segment | None]:
    """Input ids for the next turn; updates `record.segment` in place.

    `sampling`: the turn's SGLang sampling params; in an episode, a change of distribution
    (`sampling_changed`) starts a new segment even when the messages extend the recorded ones.

    Returns:
        (prompt ids to send to the engine, the closed segment if the request forked history
        and the old segment holds sampled tokens, else None).
    """
    seg = record.segment
    closed: Segment | None = None
    if sampling_changed(record, sampling):
        reason = "sampling_changed"
    elif seg.turns and extends(seg.messages, messages):
        ext = renderer.extend(seg.messages, messages, tools, ended_with_eos=seg.ended_with_eos)
        if ext is not None:
            seg.append(ext.suffix_ids, sampled=False)
            seg.messages = messages
            seg.tools = tools
            return list(seg.token_ids), None
        exact = all(_exact_same(r, m) for r, m in zip(seg.messages, messages, strict=False))
        reason = "template_rewrites_history" if exact else "tool_arguments_reformatted"
    else:
        reason = fork_reason(seg.messages, messages)
    if seg.turns:
        count_fork(record, reason)
        closed = seg if seg.sampled_tokens else None
        seg = Segment(index=seg.index + 1)
        record.segment = seg
    ids = renderer.prompt_ids(messages, tools)
    seg.append(ids, sampled=False)
    seg.prompt_length = len(ids)
    seg.messages = messages
    seg.tools = tools
    return list(seg.token_ids), closed


def set_sampling(seg: Segment, sampling: dict[str, Any]) -> None:
    """Store the sampling params of the segment's latest turn (what the engine got): the
    distribution's temperature, top_p, top_k, min_p, and max_new_tokens, the stop strings and
    the seed (SGLang's `sampling_seed`) when given."""
    seg.sampling = {k: float(sampling[k]) for k in ("temperature", "top_p", "top_k", "min_p")}
    seg.sampling["max_new_tokens"] = float(sampling["max_new_tokens"])
    if sampling.get("stop"):
        seg.sampling["stop"] = list(sampling["stop"])
    if sampling.get("sampling_seed") is not None:
        seg.sampling["seed"] = int(sampling["sampling_seed"])


def _finish(finish_type: str, reply: dict[str, Any]) -> str:
    return "tool_calls" if finish_type == "stop" and reply.get("tool_calls") else finish_type


def sampled_reply(gen: Generation, message: dict[str, Any]) -> SampledReply:
    """The recorded form of one engine result and the assistant message the client got for it
    (made once per choice, right after the engine answered)."""
    return SampledReply(  # validated: its own lists, never the engine result's
        output_ids=gen.output_ids,
        logprobs=gen.output_logprobs,
        weight_version=gen.weight_version,
        versions=gen.output_versions,
        renormalized=gen.renormalized,
        finish_reason=_finish(gen.finish_type, message),
        matched_eos=gen.matched_eos,
        message=message,
    )


def record_reply(record: SessionRecord, reply: SampledReply, sampling: dict[str, Any]) -> None:
    """Append a sampled reply to the session's segment as its next turn: the engine's ids with
    their logprobs and weight versions (loss mask 1), and the reply message."""
    seg = record.segment
    _add_turn(seg, reply)
    seg.ended_with_eos = reply.matched_eos
    seg.mark_turn()
    set_sampling(seg, sampling)


def candidate_segment(seg: Segment, c: SampledReply) -> Segment:
    """A copy of `seg` with choice `c` appended as the last turn (for its own Sample)."""
    out = seg.model_copy(deep=True)
    _add_turn(out, c)
    return out


def _add_turn(seg: Segment, reply: SampledReply) -> None:
    """Append `reply` to `seg` as its next turn: sampled ids (loss mask 1) with their
    logprobs, weight versions and renormalised marks, the message, the finish reason."""
    seg.turn_start = len(seg.token_ids)
    seg.append(
        reply.output_ids,
        sampled=True,
        logprobs=reply.logprobs,
        versions=reply.token_versions(),
        renormalized=reply.renormalized,
    )
    seg.messages = [*seg.messages, reply.message]
    seg.turns += 1
    seg.finish_reason = reply.finish_reason


def chosen_candidate(record: SessionRecord, messages: list[dict[str, Any]]) -> int | None:
    """Index of the choice the request continues with: the assistant message sent back right
    after the recorded request messages equals that choice's message; None if none does."""
    pos = len(record.segment.messages)
    if len(messages) <= pos:
        return None
    sent = messages[pos]
    for k, c in enumerate(record.candidates):
        if _same_message(c.message, sent):
            return k
    return None


def continues_chat(messages: list[dict[str, Any]]) -> Callable[[Segment, int], bool]:
    """Whether a chat request's `messages` extend a segment's conversation as it was right
    after its turn `k` (`branches.Continues`)."""

    def check(seg: Segment, k: int) -> bool:
        return extends(seg.messages[: seg.checkpoints[k].messages], messages)

    return check


def rewrite_reason(recorded: list[dict[str, Any]], messages: list[dict[str, Any]]) -> str | None:
    """Why `messages` rewrite the `recorded` conversation (a `FORK_REASONS` entry), or None
    when they only leave it: after the messages both share, the request adds no assistant
    message (a parallel request on the same history, a regenerated turn, a new conversation)."""
    shared = 0
    for r, m in zip(recorded, messages, strict=False):
        if not _same_message(r, m):
            break
        shared += 1
    if not any(m.get("role") == "assistant" for m in messages[shared:]):
        return None
    return fork_reason(recorded, messages)
