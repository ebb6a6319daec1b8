"""The session records this gateway saved last, kept in memory so the next turn of the same
session does not read and parse its whole record from Redis again.

A stored record carries `rev`, a random id written with every save. A turn hands the rev of the
record it holds to the lock script, which compares it with the stored record's first bytes
under the lock: equal, the held record is the stored one (nothing else saved the session since,
this replica or another) and no record crosses the wire; different or absent, the stored record
is read as before. Taking a record out of the cache hands it to the turn (it mutates it); only a
successful save puts it back, so a failed turn's half-changed record is never reused.

The cache is bounded by the size of the stored JSON of its records (their Python objects take
1 to 7 times that: 7 for per-token lists, about 1 for text), least recently saved evicted first.
Finished sessions are not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from flywheel.core.metrics import labeled_counter
from flywheel.gateway.recording.records import SessionRecord

READS = labeled_counter(
    "flywheel_gateway_record_reads_total",
    "Session records a turn took under its lock, by where they came from: 'cached' (this "
    "gateway's own last save, still current), 'stale' (cached but saved elsewhere since: read "
    "from Redis), 'redis' (not cached)",
    "source",
    ("cached", "stale", "redis"),
)


def rev_prefix(rev: str) -> str:
    """The first bytes of a stored record whose rev is `rev` (`rev` is its first field)."""
    return f'{{"rev":"{rev}"'


@dataclass
class Cached:
    rev: str
    record: SessionRecord
    size: int
    """Bytes of the record's stored JSON."""


class RecordCache:
    """Session id -> the record this gateway saved last (see the module docstring). Safe to
    use from worker threads (sessions are created in one).

    Args:
        max_bytes: budget in bytes of stored JSON over all cached records; 0 = no cache.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.size = 0
        """Bytes of stored JSON of the records held."""
        self._entries: OrderedDict[str, Cached] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, session_id: str) -> Cached | None:
        """Remove and return the session's entry (the caller owns its record now)."""
        with self._lock:
            return self._pop(session_id)

    def _pop(self, session_id: str) -> Cached | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.size -= entry.size
        return entry

    def peek(self, session_id: str) -> Cached | None:
        """The session's entry, left in the cache (read it, do not change it)."""
        return self._entries.get(session_id)

    def give_back(self, session_id: str, entry: Cached) -> None:
        """Return an entry taken but not used (the session was busy), unless the session was
        saved meanwhile (its newer entry stays)."""
        with self._lock:
            if session_id not in self._entries:
                self._insert(session_id, entry)

    def put(self, session_id: str, record: SessionRecord, size: int) -> None:
        """Keep `record` as just saved with `record.rev`, its stored JSON `size` bytes long (the
        caller no longer changes it). A finished session is dropped instead."""
        keep = record.rev and record.status == "open"
        entry = Cached(record.rev, record, size) if keep else None
        with self._lock:
            self._pop(session_id)
            if entry is not None:
                self._insert(session_id, entry)

    def _insert(self, session_id: str, entry: Cached) -> None:
        if entry.size > self.max_bytes:
            return
        self._entries[session_id] = entry
        self.size += entry.size
        while self.size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.size -= evicted.size
