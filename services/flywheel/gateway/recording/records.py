"""What a session stores in Redis: the exact token history of its current segment (prompt ids,
then per turn the sampled ids with the engine's logprobs and weight version and the template ids
between turns), the n > 1 choices waiting to be picked, the live-mode branches and turn waiting
for its next state, and the Samples queued for the record's next save (session/store.py saves them
atomically). Every part is typed and stored as JSON; Samples are built from them once, when
published (sample.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class Checkpoint(BaseModel):
    """The segment's extent right after one of its turns (a later request may continue there)."""

    messages: int
    tokens: int
    text: int = -1
    """Length of `Segment.text` (raw completions with a text prompt); -1 = not text."""
    ended_with_eos: bool = False


_EXACT_FLOATS = ConfigDict(ser_json_inf_nan="strings")
"""A logprob of -inf (an engine that reports none for a token) is stored as "-Infinity" and
read back as -inf, not as null (which would not read back at all)."""


class Segment(BaseModel):
    """Token-faithful record of consecutive turns. Per-token lists all have the same length."""

    model_config = _EXACT_FLOATS

    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    """Engine logprob of each sampled token; 0.0 where loss_mask is 0."""
    versions: list[int] = Field(default_factory=list)
    """Weight version of each sampled token; -1 where loss_mask is 0."""
    prompt_length: int = 0
    messages: list[dict[str, Any]] = Field(default_factory=list)
    """The conversation as recorded: request messages plus the assistant replies produced."""
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    finish_reason: str = ""
    ended_with_eos: bool = False
    sampling: dict[str, Any] = Field(default_factory=dict)
    """The latest turn's sampling params: floats for the distribution's keys and max_new_tokens,
    "stop" (list of strings) and "seed" (int) when the client gave them."""
    text: str = ""
    """Raw completions: the recorded prompt text + completion texts (the extension check)."""
    turn_start: int = 0
    """Offset of the last turn's first sampled token (live mode masks everything before it)."""
    checkpoints: list[Checkpoint] = Field(default_factory=list)
    """One per turn, in order: where the segment ended right after that turn."""
    renormalized: list[tuple[int, int]] = Field(default_factory=list)
    """[start, end) token spans whose logprobs the engine renormalised over a grammar's allowed
    tokens (`Generation.renormalized`); they become `Sample.logprob_renormalized`."""

    def append(
        self,
        ids: list[int],
        *,
        sampled: bool,
        logprobs: list[float] | None = None,
        versions: list[int] | None = None,
        renormalized: bool = False,
    ) -> None:
        """Append template ids (`sampled=False`) or engine-sampled ids with logprobs/versions;
        `renormalized`: those logprobs are renormalised over a grammar (a span is kept)."""
        n = len(ids)
        if sampled and renormalized and n:
            self.renormalized.append((len(self.token_ids), len(self.token_ids) + n))
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * n)
        self.logprobs.extend(logprobs if sampled and logprobs is not None else [0.0] * n)
        self.versions.extend(versions if sampled and versions is not None else [-1] * n)
        if not (
            len(self.token_ids) == len(self.loss_mask) == len(self.logprobs) == len(self.versions)
        ):
            raise AssertionError("segment per-token lists diverged in length")

    @model_validator(mode="after")
    def _legacy_checkpoint(self) -> Segment:
        self.legacy_checkpoint()
        return self

    def legacy_checkpoint(self) -> None:
        """A segment stored before checkpoints existed ends right after its last turn (also
        called once a segment's tokens are read from its log)."""
        if self.turns and not self.checkpoints and self.token_ids:
            self.mark_turn()

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def mark_turn(self) -> None:
        """Record a checkpoint at the current end (call right after a turn is appended)."""
        self.checkpoints.append(
            Checkpoint(
                messages=len(self.messages),
                tokens=len(self.token_ids),
                text=len(self.text) if self.text else -1,
                ended_with_eos=self.ended_with_eos,
            )
        )

    def upto(self, k: int) -> Segment:
        """A copy of this segment cut right after its turn `k` (0-based): the ids, masks,
        messages and text exactly as they were recorded then, the turn's later tokens dropped."""
        cp = self.checkpoints[k]
        out = self.model_copy(deep=True)
        for name in ("token_ids", "loss_mask", "logprobs", "versions"):
            setattr(out, name, getattr(out, name)[: cp.tokens])
        out.renormalized = [(a, min(b, cp.tokens)) for a, b in out.renormalized if a < cp.tokens]
        out.messages = out.messages[: cp.messages]
        out.text = out.text[: cp.text] if cp.text >= 0 else ""
        out.ended_with_eos = cp.ended_with_eos
        out.turns = k + 1
        out.checkpoints = out.checkpoints[: k + 1]
        out.turn_start = min(out.turn_start, cp.tokens)
        return out


class SampledReply(BaseModel):
    """One sampled choice as recorded: the engine's ids, logprobs and per-token weight versions,
    how it ended, and the assistant message the client got. Made once from the engine's
    `Generation` (history.sampled_reply); a turn appends it to its segment
    (history.record_reply), and an n > 1 turn keeps its choices as they are until the client
    sends one back (`SessionRecord.candidates`)."""

    model_config = _EXACT_FLOATS

    output_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    """stop | length | tool_calls (a stop with tool calls in the reply)."""
    matched_eos: bool
    message: dict[str, Any]
    """The assistant message the client got for this choice."""
    versions: list[int] = []
    """Per output token, its weight version when they differ (see Generation.output_versions);
    empty when every token is `weight_version`'s."""
    renormalized: bool = False
    """The logprobs are renormalised over a grammar's allowed tokens (Generation.renormalized)."""

    def token_versions(self) -> list[int]:
        """The weight version of each output token, shape [len(output_ids)]."""
        return self.versions or [self.weight_version] * len(self.output_ids)


class PendingTurn(BaseModel):
    """Live mode: a turn waiting for its next state, as its session record keeps it: the turn's
    place in its segment and the rewards posted while it waits.

    The Sample is built from this and the segment once, when it is published
    (sample.turn_sample): the segment cut at the checkpoint is exactly what it was right after
    the turn (segments only grow; `Segment.upto`), and its finish reason, sampling params and
    tools are still the turn's (a request that continues the turn publishes it before it
    extends the segment; one that does not moves the segment aside as a branch), so the record
    never holds the conversation twice."""

    checkpoint: int
    """Index of the turn's checkpoint in its segment."""
    start: int
    """Offset of the turn's first sampled token (the Sample's `prompt_length`)."""
    turn_index: int
    """The turn's index in the session."""
    choice: int | None = None
    """n > 1: the choice the client continued with (part of the sample id)."""
    rewards: dict[str, float] = Field(default_factory=dict)
    """Rewards posted for this turn while it waits (`/v1/sessions/<id>/reward`)."""
    created_at: float = Field(default_factory=time.time)
    """When the turn was sampled (the Sample's `created_at`, Unix seconds)."""

    @property
    def key(self) -> str:
        """What makes the Sample's id unique in the session: `turn/<i>[/choice/<k>]`."""
        return f"turn/{self.turn_index}" + ("" if self.choice is None else f"/choice/{self.choice}")


class SegmentSample(BaseModel):
    """A Sample due from a whole segment, or from only its last turn (`turn_only`): an episode
    segment closed by a fork or by the finish, an n > 1 choice not continued (its segment with
    the choice appended). Episode sessions hold these for their finish (as JSON in the held
    list, `SessionRecord.held`); the Sample is built from one once, when it is published
    (sample.segment_sample)."""

    model_config = _EXACT_FLOATS

    segment: Segment
    key: str = ""
    """What makes the Sample's id unique in the session (default: the segment's index)."""
    turn_index: int | None = None
    """The session-wide turn index (default: the segment's last turn)."""
    turn_only: bool = False
    """Only the segment's last turn is trainable (loss mask 0 before `Segment.turn_start`)."""
    created_at: float = Field(default_factory=time.time)
    """When the Sample became due (its `created_at`, Unix seconds)."""


class Branch(BaseModel):
    """Live mode: a turn that waits for its next state while the session went on elsewhere
    (a parallel request on the same history, a regenerated or rewritten turn)."""

    segment: Segment
    """The segment as it was right after the turn (a later request may continue it)."""
    pending: PendingTurn
    """The turn waiting for its next state."""


class SessionRecord(BaseModel):
    model_config = _EXACT_FLOATS

    rev: str = ""
    """Random id of this stored version, new at every save; kept first in the stored JSON so
    the lock script can compare it without parsing (record_cache.py)."""
    session_id: str
    group_id: str = ""
    task: dict[str, Any] = Field(default_factory=dict)
    """Task metadata for the reward service (e.g. `answer`, `verifier`)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["episode", "live"] = "episode"
    eval: bool = False
    """Evaluation sessions are served but never become training data."""
    status: Literal["open", "finished"] = "open"
    created_at: float = Field(default_factory=time.time)
    owner: str = ""
    segment: Segment = Field(default_factory=Segment)
    samples_published: int = 0
    forks: int = 0
    fork_reasons: dict[str, int] = Field(default_factory=dict)
    """Forks of this session per reason (history.FORK_REASONS)."""
    turns: int = 0
    """Assistant turns recorded in the whole session (across segments): the next turn's index."""
    finish_request: str = ""
    """Digest of the finish request (reward, following messages): a repeat of the same finish
    (a client retrying after a lost response) is answered again instead of refused."""
    finish_published: int = 0
    """`samples_published` of the finish response (what a repeated finish answers)."""
    rewards: dict[str, float] = Field(default_factory=dict)
    """Rewards posted for the episode Sample (episode mode), published with it at finish."""
    pending: PendingTurn | None = None
    """Live mode: the latest turn, waiting for its next state."""
    candidates: list[SampledReply] = Field(default_factory=list)
    """n > 1 in a session: the choices of the last turn until the client sends one back."""
    branches: list[Branch] = Field(default_factory=list)
    """Live mode: other turns waiting for their next state, oldest first (see branches.py)."""
    finished_by: str = ""
    """Who finished the session: "client" (a finish request) or "idle" (the gateway's sweep)."""
    log_tokens: int = 0
    """Tokens of `segment` stored in the session's log, not in this record's JSON
    (segment_log.py)."""
    log_messages: int = 0
    """Messages of `segment` stored in the session's log."""
    held: int = 0
    """Episode mode: Samples made before the finish (segments closed by a fork, n > 1 choices
    not continued), held in the session's held list until the finish publishes them with the
    episode's rewards."""
    _outbox: list[Outgoing] = PrivateAttr(default_factory=list)
    """Samples to add to their stream when this record is saved (never stored itself)."""
    _log: Any = PrivateAttr(default=None)
    """What the session's stored log holds of `segment` (segment_log.Logged; None: unknown,
    the next save rewrites it)."""
    _release_held: bool = PrivateAttr(default=False)
    """The next save empties the held list (the finish published what it held)."""

    def queue(self, item: Outgoing) -> None:
        """Publish `item` with the next save of this record: `SessionStore.release` adds it to
        its stream in the same atomic step that saves the record, so a turn that fails or a
        gateway that dies before the save publishes nothing, and a saved turn everything, once.
        """
        self._outbox.append(item)


@dataclass(frozen=True)
class Outgoing:
    """A serialized Sample waiting for its record's save, and what the log says about it.

    `high_water` / `watch_group`: the stream's backpressure rule (`StreamProducer`), checked
    by the save itself."""

    stream: str
    payload: bytes
    sample_id: str
    turn_index: int
    tokens: int
    next_state_role: str
    high_water: int = 0
    watch_group: str = ""
    hold: bool = False
    """Kept in the session's held list instead of the stream (see `SessionRecord.held`)."""
