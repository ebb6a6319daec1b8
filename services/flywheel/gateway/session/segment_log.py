"""How a session record is stored: its head, and its current segment's log.

The per-token lists and the messages of a session's current segment grow every turn; written
whole with the rest of the record, every save would cost the whole conversation again (a
20,000-token record is about 430 KB of JSON). They are stored apart, in a Redis list next to the
record (`<session key>:log`): each save appends one chunk with the tokens and messages added
since the last save (`LogChunk`), and the record itself (the head) holds everything else plus
the counts the log must add up to (`SessionRecord.log_tokens`, `log_messages`).

A save appends when the record's segment is the very object saved or read last, with the same
per-token list objects (they only grow, by `Segment.append`) and the same messages before the
new ones; otherwise (a new segment, a segment copied from a branch, history re-serialized by the
client, or `MAX_CHUNKS` chunks already) it rewrites the log with one chunk. Reading concatenates
the chunks, then whatever per-token lists the head still holds (records stored before the log
existed hold all of them there).

The head still grows with what it holds whole: live-mode branches (turns waiting on other
histories, branches.py, each with its segment) and the recorded text of a raw-completions
segment (`Segment.text`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, Field

from flywheel.gateway.recording.records import _EXACT_FLOATS, Segment, SessionRecord

TOKEN_FIELDS = ("token_ids", "loss_mask", "logprobs", "versions")
"""The segment's per-token lists (all the same length)."""
HEAD_EXCLUDE = {"segment": {*TOKEN_FIELDS, "messages"}}
"""What the stored head leaves to the log."""
MAX_CHUNKS = 64
"""Chunks a log may hold before a save rewrites it as one (bounds the work of reading it)."""


class LogChunk(BaseModel):
    """What one save added to the current segment (or, first in a rewritten log, all of it)."""

    model_config = _EXACT_FLOATS

    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)


@dataclass
class Logged:
    """What the stored log holds of a record's current segment (kept with the record object
    that was read or saved, never stored)."""

    segment: Segment
    """The segment object whose tokens the log holds (another object: the log is rewritten)."""
    lists: tuple[list, ...]
    """Its per-token list objects, in TOKEN_FIELDS order, as they were at the save."""
    tokens: int
    messages: tuple[dict[str, Any], ...]
    chunks: int
    size: int
    """Bytes of the log's chunks."""


@dataclass
class StoredForm:
    """A record as one save writes it."""

    head: str
    """The record's JSON without its current segment's per-token lists and messages."""
    chunk: str
    """The log chunk to add ("" = nothing new)."""
    rewrite: bool
    """Delete the log before adding `chunk` (it held another segment, or too many chunks)."""
    logged: Logged
    """What the log holds once the save is applied (becomes `record._log`)."""
    chunks_before: int
    """Chunks the log holds before the save (what an append expects to find)."""

    @property
    def size(self) -> int:
        """Bytes of the stored record, head and log."""
        return len(self.head) + self.logged.size


def _lists(seg: Segment) -> tuple[list, ...]:
    return tuple(getattr(seg, name) for name in TOKEN_FIELDS)


def _appends(seg: Segment, log: Logged | None) -> bool:
    """Whether `seg` is the logged segment grown only at its end."""
    if log is None or log.segment is not seg or log.chunks >= MAX_CHUNKS:
        return False
    if any(a is not b for a, b in zip(_lists(seg), log.lists, strict=True)):
        return False
    if len(seg.token_ids) < log.tokens or len(seg.messages) < len(log.messages):
        return False
    # The same JSON as stored (`==` would take {"a": 1, "b": 2} for {"b": 2.0, "a": 1}).
    return all(
        a is b or _json(a) == _json(b) for a, b in zip(seg.messages, log.messages, strict=False)
    )


def _json(message: dict[str, Any]) -> bytes:
    """`message` as JSON, keys in order, 2 and 2.0 and true apart (as the log stores it)."""
    try:
        return orjson.dumps(message)
    except TypeError:  # integers beyond 64 bits
        return json.dumps(message).encode()


def stored_form(record: SessionRecord) -> StoredForm:
    """The head and log chunk that store `record` (with its `rev` already set), given what its
    log holds (`record._log`); sets `record.log_tokens` / `log_messages` to the new counts."""
    seg, log = record.segment, record._log
    rewrite = not _appends(seg, log)
    t0, m0 = (0, 0) if rewrite or log is None else (log.tokens, len(log.messages))
    chunk = ""
    if len(seg.token_ids) > t0 or len(seg.messages) > m0:
        chunk = LogChunk(
            **{name: getattr(seg, name)[t0:] for name in TOKEN_FIELDS}, messages=seg.messages[m0:]
        ).model_dump_json()
    record.log_tokens, record.log_messages = len(seg.token_ids), len(seg.messages)
    head = record.model_dump_json(exclude=HEAD_EXCLUDE)
    before = (0, 0) if rewrite or log is None else (log.chunks, log.size)
    logged = Logged(
        seg,
        _lists(seg),
        len(seg.token_ids),
        tuple(seg.messages),
        before[0] + (1 if chunk else 0),
        before[1] + len(chunk),
    )
    return StoredForm(head, chunk, rewrite, logged, before[0])


class CorruptRecord(ValueError):
    """A stored record whose log does not add up to the counts its head states."""


def parse_stored(head: bytes | str, chunks: list[bytes]) -> SessionRecord:
    """The record stored as `head` and its log's `chunks` (oldest first), whole. A head
    without `log_tokens` holds the whole record (written by an earlier version): chunks beside
    it are ignored, and the next save rewrites the log.

    Raises:
        CorruptRecord: the chunks hold other counts of tokens or messages than the head says.
        pydantic.ValidationError: the head or a chunk is not a record's JSON.
    """
    record = SessionRecord.model_validate_json(head)
    seg = record.segment
    logged = "log_tokens" in record.model_fields_set
    if not logged:  # stored whole, by an earlier version
        chunks = []  # a log left by this version is not this record's
    parts = [LogChunk.model_validate_json(c) for c in chunks]
    tokens = sum(len(p.token_ids) for p in parts)
    messages = sum(len(p.messages) for p in parts)
    if (tokens, messages) != (record.log_tokens, record.log_messages):
        raise CorruptRecord(
            f"session {record.session_id}: its log holds {tokens} tokens and {messages} "
            f"messages, its record says {record.log_tokens} and {record.log_messages}"
        )
    if parts:
        for name in TOKEN_FIELDS:
            setattr(seg, name, [x for p in parts for x in getattr(p, name)] + getattr(seg, name))
        seg.messages = [m for p in parts for m in p.messages] + seg.messages
        seg.legacy_checkpoint()
    if not (len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs) == len(seg.versions)):
        raise CorruptRecord(f"session {record.session_id}: per-token lists differ in length")
    if logged:
        record._log = Logged(
            seg,
            _lists(seg),
            tokens,
            tuple(seg.messages[:messages]),
            len(parts),
            sum(len(c) for c in chunks),
        )
    return record
