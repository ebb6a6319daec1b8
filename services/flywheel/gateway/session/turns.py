"""Session turns: what a request in a session records and publishes, in both session modes.

Episode mode: each segment is one Sample, published when the session finishes. A segment that
a fork closed (docs/sessions.md) and the n > 1 choices the client did not continue with are
held until then (`<prefix>:session-held:<id>`, written by the same atomic save as the record),
so the finish publishes them all with the episode's outcome and posted rewards.

Live mode (docs/sessions.md): every assistant turn is one Sample, published when its next
state arrives: a later main request of the session whose history extends the turn's recorded
history (its messages after the turn: the user's reply, tool output), or the session's finish
(with the optional `next_state` of the finish body, for the latest turn). Parallel requests on
the same history, regenerated and rewritten turns are branches (branches.py): each turn waits
for a request that extends it; those still waiting at finish are published without a next
state. An idle session is finished by the gateway (sweep.py). The Sample of a live turn:

- `token_ids`: the exact prompt ids the engine got for the turn (earlier turns' sampled ids
  included as sampled, never re-tokenized) followed by the turn's sampled ids (with the sampled
  EOS); `prompt_length` = len(prompt ids);
- `loss_mask` 1, `rollout_logprobs` the engine's logprobs and `weight_versions` the engine's
  version only on the turn's sampled ids (0 / 0.0 / -1 elsewhere);
- `messages`: the request's messages + the assistant reply as the client got it (the last
  message is the judged turn); `tools_json`, `sampling`, `finish_reason` of the turn;
- `next_state`: role + content of what followed (`sample.next_state_message`; absent when
  no request extended the turn before the session finished);
- `turn_index`: the turn's index in the session (0, 1, ...), `segment_index` its segment;
  `sample_id` = uuid5(session/turn/<turn_index>[/choice/<k>]), so a re-publish is a duplicate;
- `rewards`: whatever was posted to `/v1/sessions/<id>/reward` while the turn was pending.

Turn types (header `X-Turn-Type`): `main` (default) turns are recorded as above; `side` turns
(a harness's auxiliary calls: summaries, titles, memory) are served with the session's engine
affinity but neither recorded nor counted as the next state of the pending turn.

n > 1 in a session: the choices share the session's `group_id`. The client continues with one
of them by sending it back as the assistant message of its next request; that choice joins the
segment (and, in live mode, waits for its next state), every other choice becomes its own
Sample (the segment so far + that choice, loss mask on the choice only), published when that
request arrives (live mode) or held for the finish (episode mode). Choices never sent back (the
session finished, or the next request sent none of them) are all published so.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from flywheel._proto import sample_pb2
from flywheel.core.codec import encode_sample
from flywheel.core.errors import BackpressureError, ConflictError
from flywheel.gateway.api.parsers import ParsedReply, parse_reply
from flywheel.gateway.api.schemas import ChatCompletionRequest
from flywheel.gateway.engines.calls import check_context, generate_n
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.recording.history import (
    FORKS,
    candidate_segment,
    chosen_candidate,
    continues_chat,
    prepare_prompt,
    record_reply,
    rewrite_reason,
    sampled_reply,
    set_sampling,
)
from flywheel.gateway.recording.records import (
    Outgoing,
    PendingTurn,
    Segment,
    SegmentSample,
    SessionRecord,
)
from flywheel.gateway.recording.sample import sample_id, segment_sample, turn_sample
from flywheel.gateway.render.tokenization import render_call, text_size
from flywheel.gateway.session import branches
from flywheel.gateway.session.backpressure import backlog_full, refused, served_unrecorded
from flywheel.gateway.session.locks import locked
from flywheel.gateway.session.owner import check_request_owner

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

log = logging.getLogger(__name__)
NO_NEXT_STATE = Counter(
    "flywheel_gateway_live_turns_without_next_state_total",
    "Live turns published without a next state (finished or regenerated)",
)
HELD_REFUSED = Counter(
    "flywheel_gateway_held_refused_total",
    "Episode turns refused because the session held gateway.max_held_samples "
    "Samples for its finish",
)
SIDE_TURNS = Counter(
    "flywheel_gateway_side_turns_total", "Side turns served in a session without being recorded"
)
FORKS.labels("choice_not_sent_back")
TURN_TYPES = ("main", "side")


def parse_choice(d: GatewayDeps, body: ChatCompletionRequest, gen: Generation) -> ParsedReply:
    """The client's message for one engine result (`parse_reply`; a reply cut off by the token
    limit drops its unterminated tool-call markup)."""
    return parse_reply(
        gen.text,
        tools_offered=body.tools_offered,
        tool_parser=d.settings.tool_parser,
        truncated=gen.finish_type == "length",
    )


def top_logprobs_num(body: ChatCompletionRequest) -> int:
    return (body.top_logprobs or 0) if body.logprobs else 0


Due = sample_pb2.Sample | SegmentSample
"""A Sample to publish: built already (a live turn with its next state), or due from a segment
(built when published; held as it is for an episode's finish)."""


def publish(d: GatewayDeps, record: SessionRecord, items: list[Due]) -> None:
    """Publish `items` with the record's save (nothing for evaluation sessions): each Sample is
    built (`SegmentSample`s), validated and serialized now, and added to the stream by the same
    atomic step that saves the record (`SessionRecord.queue`), so none is lost or published
    twice by a crash; that step also applies the stream's high-water mark (the save then raises
    BackpressureError). An open episode holds its `SegmentSample`s for its finish instead, as
    they are (JSON in the held list): their Samples are built then, once, with the episode's
    rewards.

    Raises:
        ContractError: a Sample violates an invariant.
        TypeError: a built Sample to hold (only episode Samples are held, and they are due
            from segments).
    """
    if record.eval:
        return
    p = d.publisher
    hold = record.mode == "episode" and record.status == "open"
    for item in items:
        if hold:
            if not isinstance(item, SegmentSample):
                raise TypeError("an open episode holds Samples due from segments only")
            seg = item.segment
            out = Outgoing(
                p.stream,
                item.model_dump_json().encode(),
                sample_id(record.session_id, item.key or str(seg.index)),
                max(seg.turns - 1, 0) if item.turn_index is None else item.turn_index,
                len(seg.token_ids),
                "",
                hold=True,
            )
            record.held += 1
        else:
            sample = item if isinstance(item, sample_pb2.Sample) else segment_sample(record, item)
            out = Outgoing(
                p.stream,
                encode_sample(sample),
                sample.sample_id,
                sample.turn_index,
                len(sample.token_ids),
                sample.next_state.role,
                high_water=p.high_water,
                watch_group=p.watch_group,
            )
            record.samples_published += 1
        record.queue(out)


def _choice_due(seg: Segment, turn: int, choice: int) -> SegmentSample:
    """An n > 1 choice not continued: its own Sample, the segment so far + the choice."""
    return SegmentSample(
        segment=seg, key=f"turn/{turn}/choice/{choice}", turn_index=turn, turn_only=True
    )


def store_turn(record: SessionRecord, seg: Segment, turn: int, choice: int | None = None) -> None:
    """Live mode: the segment's last turn (session turn index `turn`) waits for its next state
    (`PendingTurn`: its place in the segment)."""
    record.pending = PendingTurn(
        checkpoint=len(seg.checkpoints) - 1, start=seg.turn_start, turn_index=turn, choice=choice
    )


def resolve_candidates(record: SessionRecord, messages: list[dict[str, Any]] | None) -> list[Due]:
    """Settle an n > 1 turn: the chosen choice joins the segment, the others become Samples."""
    if not record.candidates:
        return []
    seg, turn = record.segment, record.turns - 1
    k = None if messages is None else chosen_candidate(record, messages)
    out: list[Due] = [
        _choice_due(candidate_segment(seg, c), turn, i)
        for i, c in enumerate(record.candidates)
        if i != k
    ]
    if k is not None:
        record_reply(record, record.candidates[k], seg.sampling)
        if record.mode == "live":
            store_turn(record, record.segment, turn, k)
    elif messages is not None:
        FORKS.labels("choice_not_sent_back").inc()
        record.forks += 1
        record.fork_reasons["choice_not_sent_back"] = (
            record.fork_reasons.get("choice_not_sent_back", 0) + 1
        )
        if seg.sampled_tokens and record.mode == "episode":
            out.append(SegmentSample(segment=seg))
        record.segment = Segment(index=seg.index + 1 if seg.sampled_tokens else seg.index)
    record.candidates = []
    return out


def emit_turn(
    record: SessionRecord, turn: PendingTurn, seg: Segment, following: list[dict[str, Any]]
) -> list[Due]:
    """The Sample of a waiting live turn of `seg` with the messages that followed it as
    `next_state` (none: counted in `NO_NEXT_STATE` and logged)."""
    if not following:
        NO_NEXT_STATE.inc()
        log.info(
            "session %s: live turn %d published without a next state",
            record.session_id,
            turn.turn_index,
        )
    return [turn_sample(record, seg, turn, following)]


def _select_chat_branch(record: SessionRecord, messages: list[dict[str, Any]]) -> list[Due]:
    """Live mode: continue the branch the request extends (branches.py)."""
    latest = list(record.segment.messages)

    def emit(turn: PendingTurn, seg: Segment, follows: bool) -> list[Due]:
        return emit_turn(record, turn, seg, messages[len(seg.messages) :] if follows else [])

    return branches.select(
        record, continues_chat(messages), emit, rewrite=lambda: rewrite_reason(latest, messages)
    )


def check_held(d: GatewayDeps, record: SessionRecord, adding: int) -> None:
    """Refuse a turn that would make an episode session hold more than
    `gateway.max_held_samples` Samples until its finish; nothing is saved or generated then.

    Raises:
        ConflictError: (409, code `too_many_held_samples`) `record.held + adding` exceeds the
            limit; counted in `flywheel_gateway_held_refused_total` and logged.
    """
    limit = d.settings.max_held_samples
    if record.mode != "episode" or record.eval or record.held + adding <= limit:
        return
    HELD_REFUSED.inc()
    log.warning(
        "session %s: a turn would set aside %d Samples beside the %d held (limit %d); refused",
        record.session_id,
        adding,
        record.held,
        limit,
    )
    raise ConflictError(
        f"session {record.session_id} holds {record.held} Samples for its finish and this "
        f"request would set aside {adding} more (gateway.max_held_samples = {limit}); finish "
        f"the session (POST /v1/sessions/{record.session_id}/finish) and start a new one",
        param="session_id",
        code="too_many_held_samples",
    )


async def session_turn(
    d: GatewayDeps,
    body: ChatCompletionRequest,
    session_id: str,
    messages: list[dict[str, Any]],
    sampling: dict[str, Any],
    turn_type: str = "main",
) -> tuple[list[Generation], int, list[ParsedReply]]:
    """Serve one request of a session and record it.

    Returns:
        (the generations, prompt tokens, the parsed replies), one per choice.

    Raises:
        NotFoundError: no such session. ConflictError: the session is finished.
        InvalidRequestError: prompt + max_tokens exceed the context window.
        BackpressureError: a live turn with Samples to publish while the train stream is at
            its high-water mark and `gateway.live_backpressure` is `refuse`; raised before the
            engine is called (backpressure.py).
    """
    if turn_type == "side":
        record = await asyncio.to_thread(d.sessions.get, session_id)
        check_request_owner(record)
        if record.status != "open":
            raise finished_error(record)
        SIDE_TURNS.inc()
        prompt = await render_call(
            text_size(messages, body.tools), d.renderer.prompt_ids, messages, body.tools
        )
        check_context(d, prompt, sampling, capped_by_default=default_cap(body))
        side = await generate_n(
            d, prompt, sampling, body.n, top_logprobs_num(body), affinity=session_id
        )
        return side, len(prompt), [parse_choice(d, body, g) for g in side]
    gens: list[Generation] = []
    try:
        return await _recorded_turn(d, body, session_id, messages, sampling, gens)
    except _Unrecorded as served:
        return served.result
    except BackpressureError:
        if not gens:  # refused before generation (the session is as it was)
            raise
        # the backlog reached the mark while the turn was generated: answered, not recorded
        served_unrecorded(session_id, "backpressure", sum(len(g.output_ids) for g in gens))
        prompt_tokens = gens[0].prompt_tokens
        return gens, prompt_tokens, [parse_choice(d, body, g) for g in gens]


class _Unrecorded(Exception):
    """Leaves the session lock without saving: the turn was answered unrecorded."""

    def __init__(self, result: tuple[list[Generation], int, list[ParsedReply]]):
        super().__init__("served unrecorded")
        self.result = result


async def _recorded_turn(
    d: GatewayDeps,
    body: ChatCompletionRequest,
    session_id: str,
    messages: list[dict[str, Any]],
    sampling: dict[str, Any],
    gens: list[Generation],
) -> tuple[list[Generation], int, list[ParsedReply]]:
    """A main turn under the session lock (`session_turn`); `gens` is filled with the
    generations as soon as they exist, so the caller can tell a save refused after generation
    from a turn refused before it."""
    async with locked(d.sessions, session_id) as record:
        if record.status != "open":
            raise finished_error(record)
        out = resolve_candidates(record, messages)
        if record.mode == "live":
            out += _select_chat_branch(record, messages)
        prompt, closed = await render_call(
            text_size(messages, body.tools),
            prepare_prompt,
            record,
            d.renderer,
            messages,
            body.tools,
            sampling,
        )
        check_context(d, prompt, sampling, capped_by_default=default_cap(body))
        if closed is not None and record.mode == "episode":
            out.append(SegmentSample(segment=closed))
        check_held(d, record, len(out))
        unrecorded = (
            record.mode == "live" and not record.eval and bool(out) and await backlog_full(d)
        )
        if unrecorded and d.settings.live_backpressure == "refuse":
            raise refused(session_id)
        gens += await generate_n(
            d, prompt, sampling, body.n, top_logprobs_num(body), affinity=session_id
        )
        parsed = [parse_choice(d, body, g) for g in gens]
        if unrecorded:  # the lock is released, the record left as it was
            served_unrecorded(session_id, "backpressure", sum(len(g.output_ids) for g in gens))
            raise _Unrecorded((gens, len(prompt), parsed))
        turn = record.turns
        record.turns += 1
        replies = [sampled_reply(g, p.message()) for g, p in zip(gens, parsed, strict=True)]
        if body.n == 1:
            record_reply(record, replies[0], sampling)
            if record.mode == "live":
                store_turn(record, record.segment, turn)
        else:
            set_sampling(record.segment, sampling)
            record.candidates = replies
        # Samples are published only once the turn succeeded: a failed request leaves the
        # stored record untouched, and a retry republishes the same sample ids at most.
        publish(d, record, out)
        return gens, len(prompt), parsed


def default_cap(body: ChatCompletionRequest) -> bool:
    """True when the request sets no completion cap (the gateway's default applies)."""
    return body.max_tokens is None and body.max_completion_tokens is None


def finished_error(record: SessionRecord) -> ConflictError:
    """The 409 for a request to a finished session (says when the gateway finished it)."""
    if record.finished_by == "idle":
        return ConflictError(
            f"session {record.session_id} was finished by the gateway after "
            "gateway.session_idle_finish_s without requests (what it held was published); "
            "create a new session"
        )
    return ConflictError(f"session {record.session_id} is finished; create a new session")
