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
- `next_state`: role + content of what followed (`recording.next_state_message`; absent when
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
import hashlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import Counter

from flywheel._proto import sample_pb2
from flywheel.core.codec import decode_sample, encode_sample
from flywheel.core.errors import (
    ConflictError,
    ContractError,
    InvalidRequestError,
    NotFoundError,
)
from flywheel.core.metrics import labeled_counter
from flywheel.gateway import branches, pending
from flywheel.gateway.engine_pool import Generation
from flywheel.gateway.engine_stream import TEXT_SINK
from flywheel.gateway.parsers import ParsedReply, parse_reply
from flywheel.gateway.recording import (
    FORKS,
    as_generation,
    build_sample,
    candidate,
    candidate_segment,
    chosen_candidate,
    continues_chat,
    next_state_message,
    prepare_prompt,
    record_generation,
    rewrite_reason,
    set_sampling,
)
from flywheel.gateway.records import Outgoing, Segment, SessionRecord
from flywheel.gateway.schemas import ChatCompletionRequest
from flywheel.gateway.sessions import (
    LOCK_LEASE_S,
    SessionLease,
    SessionStore,
    check_request_owner,
)
from flywheel.gateway.stops import reconcile_stop
from flywheel.gateway.tokenization import render_call, text_size

if TYPE_CHECKING:
    from flywheel.gateway.app import GatewayDeps

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
FINISHED = labeled_counter(
    "flywheel_gateway_sessions_finished_total",
    "Sessions finished, by who finished them (client: a finish request; idle: the gateway, "
    "after gateway.session_idle_finish_s without requests)",
    "reason",
    ("client", "idle"),
)
TURN_TYPES = ("main", "side")
HELD_LOST = Counter(
    "flywheel_gateway_held_samples_lost_total",
    "Samples an episode held until its finish that were gone at the finish",
)


def parse_choice(d: GatewayDeps, body: ChatCompletionRequest, gen: Generation) -> ParsedReply:
    return parse_reply(
        gen.text, tools_offered=body.tools_offered, tool_parser=d.settings.tool_parser
    )


def _nth(sampling: dict[str, Any], i: int) -> dict[str, Any]:
    """Sampling params of choice i: a given seed is offset so the n choices differ."""
    if i and "sampling_seed" in sampling:
        return {**sampling, "sampling_seed": (sampling["sampling_seed"] + i) % 2**63}
    return sampling


def top_logprobs_num(body: ChatCompletionRequest) -> int:
    return (body.top_logprobs or 0) if body.logprobs else 0


async def generate_n(
    d: GatewayDeps,
    prompt: list[int],
    sampling: dict[str, Any],
    n: int,
    top_logprobs: int = 0,
    affinity: str = "",
) -> list[Generation]:
    """n engine calls for one prompt (distinct seeds when a seed is given). A request answered
    as its text is sampled (`engine_stream.TEXT_SINK` set, n = 1) streams its engine call."""
    extra = {"top_logprobs_num": top_logprobs} if top_logprobs else {}
    sink = TEXT_SINK.get()
    if sink is not None and n == 1 and hasattr(d.engines, "generate_stream"):
        gens = [await d.engines.generate_stream(prompt, sampling, affinity, on_text=sink, **extra)]
    else:
        gens = await asyncio.gather(
            *[d.engines.generate(prompt, _nth(sampling, i), affinity, **extra) for i in range(n)]
        )
    eos = d.renderer.eos_token_id
    return [
        reconcile_stop(
            gen, d.renderer.decode, sampling.get("stop") or [], () if eos is None else (eos,)
        )
        for gen in gens
    ]


@asynccontextmanager
async def locked(
    store: SessionStore, session_id: str, timeout_s: float = 600.0
) -> AsyncIterator[SessionRecord]:
    """Async form of `SessionStore.locked`: saved on normal exit, untouched on error.

    The lock is taken and the record read in one Redis round trip, and saved and released in
    one more, both on the event loop (no thread hop); while another request holds the session
    this waits on the event loop (5 ms doubling to 100 ms between tries, each +-50% at random).

    Raises:
        NotFoundError: no such session, or one of another key than the request's
            (`REQUEST_OWNER`). ConflictError: busy for `timeout_s` seconds, or the lease
            expired while the turn ran (nothing saved).
    """
    deadline, pause = time.monotonic() + timeout_s, 0.005
    while (lease := await store.atry_acquire(session_id, LOCK_LEASE_S)) is None:
        if time.monotonic() >= deadline:
            raise ConflictError(f"session {session_id} is busy", param="session_id")
        await asyncio.sleep(pause * random.uniform(0.5, 1.5))  # waiters spread their tries
        pause = min(pause * 2, 0.1)
    try:
        check_request_owner(lease.record)
    except NotFoundError:
        await asyncio.shield(store.arelease(lease))
        raise
    renewal = asyncio.create_task(_renew(store, lease))
    try:
        yield lease.record
    except BaseException:
        renewal.cancel()
        await asyncio.shield(store.arelease(lease))
        raise
    renewal.cancel()
    # shielded: a request cancelled meanwhile (its client gone, its time limit) still ends
    # its one-round-trip save or unlock, never leaving the lock to expire with its lease
    await asyncio.shield(store.arelease(lease, lease.record))


async def _renew(store: SessionStore, lease: SessionLease) -> None:
    """Renew the session lock's lease while a turn runs (a long generation keeps it; a crashed
    gateway's lock expires after `LOCK_LEASE_S`)."""
    while True:
        await asyncio.sleep(LOCK_LEASE_S / 3)
        try:
            held = await store.arenew(lease)
        except redis.RedisError as exc:  # bounded: the next renewal retries
            log.warning("renewing the lock of session %s failed: %s", lease.session_id, exc)
            continue
        if not held:
            log.error("lost the lock of session %s while a turn was running", lease.session_id)
            return


def publish(d: GatewayDeps, record: SessionRecord, samples: list[sample_pb2.Sample]) -> None:
    """Publish `samples` with the record's save (nothing for evaluation sessions): they are
    validated and serialized now and added to the stream by the same atomic step that saves
    the record (`SessionRecord.queue`), so none is lost or published twice by a crash; that
    step also applies the stream's high-water mark (the save then raises BackpressureError).

    Raises:
        ContractError: a Sample violates an invariant.
    """
    if record.eval:
        return
    p = d.publisher
    hold = record.mode == "episode" and record.status == "open"
    for sample in samples:
        record.queue(
            Outgoing(
                p.stream,
                encode_sample(sample),
                sample.sample_id,
                sample.turn_index,
                len(sample.token_ids),
                sample.next_state.role,
                high_water=p.high_water,
                watch_group=p.watch_group,
                hold=hold,
            )
        )
        if hold:
            record.held += 1
        else:
            record.samples_published += 1


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


def _turn_sample(
    record: SessionRecord,
    seg: Segment,
    turn: int,
    choice: int | None = None,
    conversation: bool = True,
) -> sample_pb2.Sample:
    key = f"turn/{turn}" + ("" if choice is None else f"/choice/{choice}")
    return build_sample(
        record, seg, turn_only=True, sample_key=key, turn_index=turn, conversation=conversation
    )


def store_turn(record: SessionRecord, seg: Segment, turn: int, choice: int | None = None) -> None:
    """Live mode: the segment's last turn (session turn index `turn`) waits for its next state
    (pending.py)."""
    record.pending = pending.stored(_turn_sample(record, seg, turn, choice, False), seg)


def _resolve_candidates(
    record: SessionRecord, messages: list[dict[str, Any]] | None
) -> list[sample_pb2.Sample]:
    """Settle an n > 1 turn: the chosen choice joins the segment, the others become Samples."""
    if not record.candidates:
        return []
    seg, turn = record.segment, record.turns - 1
    k = None if messages is None else chosen_candidate(record, messages)
    out = [
        _turn_sample(record, candidate_segment(seg, c), turn, i)
        for i, c in enumerate(record.candidates)
        if i != k
    ]
    if k is not None:
        chosen = record.candidates[k]
        record_generation(record, as_generation(chosen), seg.sampling, chosen.message)
        if record.mode == "live":
            store_turn(record, record.segment, turn, k)
    elif messages is not None:
        FORKS.labels("choice_not_sent_back").inc()
        record.forks += 1
        record.fork_reasons["choice_not_sent_back"] = (
            record.fork_reasons.get("choice_not_sent_back", 0) + 1
        )
        if seg.sampled_tokens and record.mode == "episode":
            out.append(build_sample(record, seg))
        record.segment = Segment(index=seg.index + 1 if seg.sampled_tokens else seg.index)
    record.candidates = []
    return out


def emit_turn(
    record: SessionRecord, stored: str, seg: Segment, following: list[dict[str, Any]]
) -> list[sample_pb2.Sample]:
    """The Sample of a waiting live turn of `seg` with the messages that followed it as
    `next_state` (none: counted in `NO_NEXT_STATE` and logged)."""
    sample = pending.restore(stored, seg)
    message = next_state_message(following)
    if message is None:
        NO_NEXT_STATE.inc()
        log.info(
            "session %s: live turn %d published without a next state",
            record.session_id,
            sample.turn_index,
        )
    else:
        sample.next_state.CopyFrom(message)
    return [sample]


def _select_chat_branch(
    record: SessionRecord, messages: list[dict[str, Any]]
) -> list[sample_pb2.Sample]:
    """Live mode: continue the branch the request extends (branches.py)."""
    latest = list(record.segment.messages)

    def emit(stored: str, seg: Segment, follows: bool) -> list[sample_pb2.Sample]:
        return emit_turn(record, stored, seg, messages[len(seg.messages) :] if follows else [])

    return branches.select(
        record, continues_chat(messages), emit, rewrite=lambda: rewrite_reason(latest, messages)
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
        gens = await generate_n(
            d, prompt, sampling, body.n, top_logprobs_num(body), affinity=session_id
        )
        return gens, len(prompt), [parse_choice(d, body, g) for g in gens]
    async with locked(d.sessions, session_id) as record:
        if record.status != "open":
            raise finished_error(record)
        out = _resolve_candidates(record, messages)
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
            out.append(build_sample(record, closed))
        check_held(d, record, len(out))
        gens = await generate_n(
            d, prompt, sampling, body.n, top_logprobs_num(body), affinity=session_id
        )
        parsed = [parse_choice(d, body, g) for g in gens]
        turn = record.turns
        record.turns += 1
        if body.n == 1:
            record_generation(record, gens[0], sampling, parsed[0].message())
            if record.mode == "live":
                store_turn(record, record.segment, turn)
        else:
            set_sampling(record.segment, sampling)
            record.candidates = [
                candidate(g, p.message()) for g, p in zip(gens, parsed, strict=True)
            ]
        # Samples are published only once the turn succeeded: a failed request leaves the
        # stored record untouched, and a retry republishes the same sample ids at most.
        publish(d, record, out)
        return gens, len(prompt), parsed


def check_context(
    d: GatewayDeps,
    prompt: list[int],
    sampling: dict[str, Any],
    *,
    capped_by_default: bool = False,
    param: str = "messages",
) -> None:
    """Refuse a prompt whose completion cannot fit the context window.

    `capped_by_default`: the client set no max_tokens, so `sampling["max_new_tokens"]` is the
    gateway's default; it is lowered in place to what is left of the window (context - prompt
    - 1, the engine's own clamp) instead of refusing.

    Raises:
        InvalidRequestError: `context_length_exceeded`, naming `param`: the prompt leaves no
            room, or the client's max_tokens does not fit.
    """
    limit = d.context_length
    room = limit - len(prompt) - 1  # SGLang clamps max_new_tokens to context - input - 1
    if capped_by_default and room > 0:
        sampling["max_new_tokens"] = min(sampling["max_new_tokens"], room)
    if sampling["max_new_tokens"] > room:
        asked = "" if capped_by_default else f" + max_tokens ({sampling['max_new_tokens']})"
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens){asked} must stay below the context window of "
            f"{limit} tokens; shorten the conversation"
            + ("" if capped_by_default else " or lower max_tokens"),
            param=param,
            code="context_length_exceeded",
        )


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


async def finish(
    d: GatewayDeps,
    session_id: str,
    reward: float | None,
    following: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Finish a session and publish what it still holds (see the module docstring).

    `reward` (as `rewards["outcome"]`) and the rewards posted for the episode go on every
    Sample published here; `reward` replaces an "outcome" posted before (logged). Finishing
    is idempotent: the same finish sent again (a retry after a lost response) gets the first
    answer with `"replayed": true` and publishes nothing.
    While a turn holds the session this waits for it on the event loop (`locked`), never in a
    worker thread, so waiting finishes cannot starve the thread pool other requests use.
    Raises: NotFoundError; ConflictError (finished by a different finish request, or by the
    gateway's idle sweep, or the session stayed busy for 600 s).
    """
    digest = hashlib.sha256(
        json.dumps([reward, following or []], sort_keys=True, default=str).encode()
    ).hexdigest()
    async with locked(d.sessions, session_id) as record:
        if record.status == "finished":
            if record.finish_request and record.finish_request == digest:
                return {
                    "session_id": session_id,
                    "status": "finished",
                    "samples_published": record.finish_published,
                    "replayed": True,
                }
            if record.finished_by == "idle":
                raise finished_error(record)
            raise ConflictError(
                f"session {session_id} is already finished (by a finish with a "
                "different reward or following messages)"
            )
        record.finish_request = digest
        # building a long episode's Sample takes milliseconds: off the event loop
        published = len(
            await asyncio.to_thread(finish_record, d, record, reward, following, "client")
        )
    return {"session_id": session_id, "status": "finished", "samples_published": published}


def _held(d: GatewayDeps, record: SessionRecord) -> list[sample_pb2.Sample]:
    """The Samples an episode held until its finish (`SessionRecord.held`); the save that
    publishes them empties the held list. Fewer than the record counts (the list expired, or an
    entry cannot be read) are counted and logged; the others are still published."""
    if not record.held:
        return []
    samples = []
    for payload in d.sessions.held_samples(record.session_id):
        try:
            samples.append(decode_sample(payload))
        except ContractError as exc:  # counted below with the missing ones
            log.error(
                "session %s: a held Sample cannot be read (%s); left out", record.session_id, exc
            )
    if len(samples) != record.held:
        HELD_LOST.inc(max(record.held - len(samples), 0))
        log.error(
            "session %s: %d held Samples expected, %d found; publishing those found",
            record.session_id,
            record.held,
            len(samples),
        )
    record.held = 0
    record._release_held = True
    return samples


def finish_record(
    d: GatewayDeps,
    record: SessionRecord,
    reward: float | None,
    following: list[dict[str, Any]] | None,
    by: str,
) -> list[sample_pb2.Sample]:
    """Finish a locked, open session: publish what it holds (the n > 1 choices, the live
    turns still waiting, with `following` as the latest one's next state, or the episode's
    segment), with `reward` and the posted episode rewards; the caller saves the record.

    Args:
        by: who finishes it, "client" or "idle" (`FINISHED{reason}`).

    Returns:
        The Samples published (none for evaluation sessions).
    """
    record.status = "finished"
    record.finished_by = by
    out = _resolve_candidates(record, None)
    if record.mode == "live":
        if record.pending:
            out += emit_turn(record, record.pending, record.segment, following or [])
            record.pending = ""
        for branch in record.branches:  # the latest turn's next state is not theirs
            out += emit_turn(record, branch.pending, branch.segment, [])
        record.branches = []
    else:
        out = _held(d, record) + out
        if record.segment.sampled_tokens:
            out.append(build_sample(record, record.segment))
    rewards = dict(record.rewards)
    if reward is not None:
        if rewards.get("outcome", reward) != reward:
            log.warning(
                "session %s: the finish's reward %s replaces the outcome %s posted before it",
                record.session_id,
                reward,
                rewards["outcome"],
            )
        rewards["outcome"] = reward
    for sample in out:
        for name, value in rewards.items():
            sample.rewards[name] = value
    publish(d, record, out)
    FINISHED.labels(by).inc()
    if record.eval:
        out = []
    record.finish_published = len(out)
    return out


async def post_reward(d: GatewayDeps, session_id: str, name: str, value: float) -> dict[str, Any]:
    """Attach an environment reward `rewards[name] = value` to the session's next Sample.

    Episode mode: the episode Sample(s) published at finish. Live mode: the turn waiting for
    its next state. Waits for a running turn on the event loop, like `finish`. Raises:
    NotFoundError; ConflictError when the session is finished or (live) no turn is waiting.
    """
    async with locked(d.sessions, session_id) as record:
        if record.status == "finished":
            raise ConflictError(f"session {session_id} is finished; post rewards before finish")
        if record.mode == "episode":
            record.rewards[name] = value
            return {
                "session_id": session_id,
                "applies_to": "episode",
                "rewards": dict(record.rewards),
            }
        if not record.pending:
            raise ConflictError(
                f"session {session_id} has no turn waiting for a reward: post it after the "
                "assistant turn and before the next request",
                param="session_id",
            )
        record.pending, sample = pending.with_reward(record.pending, name, value)
        return {
            "session_id": session_id,
            "applies_to": f"turn {sample.turn_index}",
            "rewards": dict(sample.rewards),
        }
