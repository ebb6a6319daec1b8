"""Finishing a session and posting rewards: what a session still holds is published.

`finish` (the client's finish request) and the idle sweep (sweep.py, `finish_record`) publish
the n > 1 choices not continued, the live turns still waiting (the latest with the finish's
`next_state`) or the episode's segments, with the finish's reward and the posted rewards.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from pydantic import ValidationError

from flywheel._proto import sample_pb2
from flywheel.core.errors import ConflictError
from flywheel.core.metrics import labeled_counter
from flywheel.gateway.recording.records import SegmentSample, SessionRecord
from flywheel.gateway.recording.sample import segment_sample
from flywheel.gateway.session.locks import locked
from flywheel.gateway.session.turns import emit_turn, finished_error, publish, resolve_candidates

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps

log = logging.getLogger(__name__)
FINISHED = labeled_counter(
    "flywheel_gateway_sessions_finished_total",
    "Sessions finished, by who finished them (client: a finish request; idle: the gateway, "
    "after gateway.session_idle_finish_s without requests)",
    "reason",
    ("client", "idle"),
)
REWARDS_UNUSED = labeled_counter(
    "flywheel_gateway_rewards_unused_total",
    "Rewards (posted or the finish's) of a session finished with no Sample to carry them "
    "(no_turns: the session had no turn)",
    "reason",
    ("no_turns",),
)
HELD_LOST = Counter(
    "flywheel_gateway_held_samples_lost_total",
    "Samples an episode held until its finish that were gone at the finish",
)


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
        unused = sorted({*record.rewards, *(["outcome"] if reward is not None else [])})
        # building a long episode's Sample takes milliseconds: off the event loop
        published = len(
            await asyncio.to_thread(finish_record, d, record, reward, following, "client")
        )
        no_turns = not record.turns
    answer: dict[str, Any] = {
        "session_id": session_id,
        "status": "finished",
        "samples_published": published,
    }
    if no_turns and unused:
        answer["rewards_unused"] = {
            "reason": "no_turns",
            "names": unused,
            "message": "the session had no turn, so no Sample carries these rewards; send its "
            "requests through the session's base_url before finishing it",
        }
    return answer


def _held(d: GatewayDeps, record: SessionRecord) -> list[SegmentSample]:
    """What an episode held until its finish (`SessionRecord.held`): the Samples due from its
    closed segments and choices not continued; the save that publishes them empties the held
    list. Fewer than the record counts (the list expired, or an entry cannot be read) are
    counted and logged; the others are still published."""
    if not record.held:
        return []
    held = []
    for payload in d.sessions.held_samples(record.session_id):
        try:
            held.append(SegmentSample.model_validate_json(payload))
        except ValidationError as exc:  # counted below with the missing ones
            log.error(
                "session %s: a held Sample cannot be read (%s); left out",
                record.session_id,
                exc.errors(include_url=False)[:1],
            )
    if len(held) != record.held:
        HELD_LOST.inc(max(record.held - len(held), 0))
        log.error(
            "session %s: %d held Samples expected, %d found; publishing those found",
            record.session_id,
            record.held,
            len(held),
        )
    record.held = 0
    record._release_held = True
    return held


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
    out = resolve_candidates(record, None)
    if record.mode == "live":
        if record.pending:
            out += emit_turn(record, record.pending, record.segment, following or [])
            record.pending = None
        for branch in record.branches:  # the latest turn's next state is not theirs
            out += emit_turn(record, branch.pending, branch.segment, [])
        record.branches = []
    else:
        out = [*_held(d, record), *out]
        if record.segment.sampled_tokens:
            out.append(SegmentSample(segment=record.segment))
    samples = [x if isinstance(x, sample_pb2.Sample) else segment_sample(record, x) for x in out]
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
    for sample in samples:
        for name, value in rewards.items():
            sample.rewards[name] = value
    if rewards and not samples:
        _count_unused(record, rewards)
    publish(d, record, list(samples))
    FINISHED.labels(by).inc()
    if record.eval:
        samples = []
    record.finish_published = len(samples)
    return samples


def _count_unused(record: SessionRecord, rewards: dict[str, float]) -> None:
    """Rewards of a session finished without a Sample to carry them: counted and logged, never
    dropped without a word (`REWARDS_UNUSED`)."""
    if record.turns:  # had turns, yet nothing to publish (all sent before): not this case
        return
    REWARDS_UNUSED.labels("no_turns").inc(len(rewards))
    log.warning(
        "session %s (%s) finished with no turn: rewards %s reach no Sample",
        record.session_id,
        record.mode,
        sorted(rewards),
    )


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
        record.pending.rewards[name] = value
        return {
            "session_id": session_id,
            "applies_to": f"turn {record.pending.turn_index}",
            "rewards": dict(record.pending.rewards),
        }
