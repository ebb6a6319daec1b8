"""Live-mode branches: several turns of one session waiting for their next state at once.

A harness may fire several requests on the same history (parallel sub-calls), regenerate a turn
or rewrite history. Each request's turn is its own Sample, and a turn's next state is taken
only from a later request whose history extends that turn's recorded history (its request
messages + its reply as the client got it).

The session's current segment and `pending` turn are its latest branch tip; `record.branches`
holds the other tips whose turn still waits (at most `MAX_BRANCHES`). Before a live request is
recorded, `select` makes the segment it continues the current one:

1. a tip whose recorded history the request extends (the longest): that tip's turn is
   published with the request's new messages as its `next_state`, and the request continues
   the tip's ids exactly;
2. else the latest turn of any tip that the request's history extends (a sibling of a later
   turn: its history stops at that earlier turn): the request continues a copy of that tip cut
   right after that turn (`Segment.upto`), so the earlier turns' sampled ids stay exact; no
   turn gets a next state;
3. else a fresh rendering in a new segment: a history that rewrites a recorded reply is a
   fork (counted by reason); a new conversation in the session, a parallel request or a
   regenerated turn rewrites nothing and is not a fork (a `fresh` branch only).

In cases 2 and 3 the current tip, if its turn waits, becomes a branch: it is published when a
later request extends it, at the session's finish (without a next state) or when it is pushed
out of `MAX_BRANCHES` (without a next state; metric and log line). Started branches are counted
in `flywheel_gateway_live_branches_total{base}` (base: `turn` for case 2, `fresh` for case 3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flywheel.core.metrics import labeled_counter
from flywheel.gateway.recording.history import FORKS
from flywheel.gateway.recording.records import Branch, PendingTurn, Segment, SessionRecord

log = logging.getLogger(__name__)
MAX_BRANCHES = 8
"""Turns waiting for their next state besides the latest, per session."""
BRANCHES = labeled_counter(
    "flywheel_gateway_live_branches_total",
    "Live requests that did not continue the session's latest turn (parallel requests, "
    "regenerated or rewritten turns)",
    "base",
    ("turn", "fresh"),
)

Continues = Callable[[Segment, int], bool]
"""`continues(segment, k)`: whether the request extends `segment` cut right after turn `k`."""
Emit = Callable[[PendingTurn, Segment, bool], list[Any]]
"""`emit(pending, segment, follows)`: the Samples (turns.Due) of a pending turn of `segment`,
with the next state the request gives after it when `follows` (else none)."""


def _tips(record: SessionRecord) -> list[tuple[Segment, PendingTurn | None]]:
    """(segment, pending) of the current tip and of every branch, newest first."""
    return [
        (record.segment, record.pending),
        *[(b.segment, b.pending) for b in reversed(record.branches)],
    ]


def _park(record: SessionRecord, emit: Emit) -> list[Any]:
    """Keep the current tip as a branch when its turn waits; drop the oldest beyond the cap."""
    out: list[Any] = []
    if record.pending:
        record.branches.append(Branch(segment=record.segment, pending=record.pending))
        record.pending = None
    while len(record.branches) > MAX_BRANCHES:
        oldest = record.branches.pop(0)
        log.warning(
            "session %s: more than %d live turns wait for their next state; the "
            "oldest is published without one",
            record.session_id,
            MAX_BRANCHES,
        )
        out += emit(oldest.pending, oldest.segment, False)
    return out


def _next_index(record: SessionRecord) -> int:
    return 1 + max(seg.index for seg, _ in _tips(record))


def select(
    record: SessionRecord,
    continues: Continues,
    emit: Emit,
    rewrite: Callable[[], str | None] = lambda: None,
) -> list[Any]:
    """Make `record.segment` the state a live request continues (module docstring).

    Args:
        record: the live session (changed in place).
        continues: whether the request extends a segment at a turn (see `Continues`).
        emit: the Samples of a tip's waiting turn (see `Emit`).
        rewrite: for case 3, the fork reason (`recording.FORK_REASONS`) when the request
            rewrites recorded history, None for a fresh branch.

    Returns:
        The Samples to publish: the continued tip's turn with its next state, and turns pushed
        out of `MAX_BRANCHES`.
    """
    seg = record.segment
    if seg.checkpoints and continues(seg, len(seg.checkpoints) - 1):  # the common case
        pending, record.pending = record.pending, None
        return emit(pending, seg, True) if pending else []
    tips = _tips(record)
    # The longest recorded history the request extends; the newest tip among equals.
    ends = [
        (seg.checkpoints[-1].tokens, -i)
        for i, (seg, _) in enumerate(tips)
        if i and seg.checkpoints and continues(seg, len(seg.checkpoints) - 1)
    ]
    if ends:
        i = -max(ends)[1]
        branch = record.branches.pop(len(record.branches) - i)
        out = _park(record, emit)
        record.segment, record.pending = branch.segment, None
        return out + emit(branch.pending, branch.segment, True)
    earlier = [
        (seg.checkpoints[k].tokens, -i, k)
        for i, (seg, _) in enumerate(tips)
        for k in range(len(seg.checkpoints) - 1)
        if continues(seg, k)
    ]
    if not earlier and not record.pending and not tips[0][0].checkpoints:
        return []  # nothing on the latest tip: the request simply starts it
    out = _park(record, emit)
    if earlier:
        _, minus_i, k = max(earlier)
        i = -minus_i
        BRANCHES.labels("turn").inc()
        record.segment = tips[i][0].upto(k)
        return out
    reason = rewrite()
    record.segment = Segment(index=_next_index(record))
    if reason is None:
        BRANCHES.labels("fresh").inc()
        return out
    FORKS.labels(reason).inc()
    record.forks += 1
    record.fork_reasons[reason] = record.fork_reasons.get(reason, 0) + 1
    log.info(
        "session %s: request rewrites the recorded history (%s); starting segment %d",
        record.session_id,
        reason,
        record.segment.index,
    )
    return out
