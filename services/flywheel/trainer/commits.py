"""The commit log: one small durable record per committed optimizer step.

A step is committed when its record is on disk (`<checkpoint_dir>/commits.jsonl`, one JSON line,
flushed and fsynced before the step's weights are pushed). A record holds what re-training the
step needs: its weight version, its groups (group id, stream entry ids in order, and each
member's staleness treatment, loss weight and version floor: its tokens of older versions
are masked as stale), the sample ids, and the RNG states at the start of the step. Full
checkpoints are written only every `checkpoint_every` steps; the stream entries of later steps
stay pending (unacked) in Redis, so the records after the newest checkpoint and the pending
entries together are the replay log. After a crash the trainer
restores the newest checkpoint, then trains the recorded steps after it again, in order, with
the same groups, treatments and RNG states (`Trainer.replay`), so every sample is trained once
in the surviving lineage.

Records at or before a durable checkpoint are no longer needed: `truncate(step)` rewrites the
log without them (atomically: temporary file, fsync, rename).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flywheel.core.streams import StreamEntry
from flywheel.trainer.groups import Group, masked_entry
from flywheel.trainer.staleness import Treatment

log = logging.getLogger(__name__)

FILE = "commits.jsonl"


@dataclass
class GroupRecord:
    """One group of a committed step."""

    group_id: str
    entry_ids: list[str]
    """Stream entry ids of the members, in training order."""
    treatments: list[tuple[str, float]] = field(default_factory=list)
    """(staleness treatment, loss weight) per member, aligned with `entry_ids`."""
    version_floors: list[int] = field(default_factory=list)
    """Oldest weight version trained per member (`Group.version_floors`; -1 = none masked;
    [] in records written before per-token staleness = none masked)."""


@dataclass
class CommitRecord:
    """What one committed step trained on (see module docstring)."""

    step: int
    """The committed optimizer step (= the weight version it produced)."""
    groups: list[GroupRecord]
    sample_ids: list[str]
    rng: dict[str, Any] = field(default_factory=dict)
    """`{"torch": base64 of torch.get_rng_state(), "python": random.getstate()}` at the start
    of the step; {} = not recorded."""

    @property
    def entry_ids(self) -> list[str]:
        return [e for g in self.groups for e in g.entry_ids]

    def groups_of(self, entries: Sequence[StreamEntry]) -> tuple[list[Group], list[str]]:
        """The step's groups rebuilt from its claimed `entries`, in the recorded order and with
        the recorded treatments; also the recorded entry ids that are missing (left out; a
        group left with no member is dropped)."""
        by_id = {e.entry_id: e for e in entries}
        groups = []
        for g in self.groups:
            treatments = g.treatments or [("fresh", 1.0)] * len(g.entry_ids)
            floors = g.version_floors or [-1] * len(g.entry_ids)
            kept = [
                (masked_entry(by_id[e], floor), (Treatment(t), w), floor)
                for e, (t, w), floor in zip(g.entry_ids, treatments, floors, strict=True)
                if e in by_id
            ]
            if kept:
                groups.append(
                    Group(
                        g.group_id,
                        0.0,
                        [e for e, _, _ in kept],
                        treatments=[t for _, t, _ in kept],
                        version_floors=[f for _, _, f in kept],
                    )
                )
        return groups, [e for e in self.entry_ids if e not in by_id]

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "weight_version": str(self.step),
                "groups": [
                    {
                        "group_id": g.group_id,
                        "entry_ids": g.entry_ids,
                        "treatments": [list(t) for t in g.treatments],
                        "version_floors": g.version_floors,
                    }
                    for g in self.groups
                ],
                "sample_ids": self.sample_ids,
                "rng": self.rng,
            }
        )

    @classmethod
    def from_json(cls, line: str) -> CommitRecord:
        """Parse one log line.

        Raises:
            ValueError: not a commit record (bad JSON or a missing field).
        """
        try:
            data = json.loads(line)
            groups = [
                GroupRecord(
                    g["group_id"],
                    list(g["entry_ids"]),
                    [(str(t[0]), float(t[1])) for t in g.get("treatments", [])],
                    [int(f) for f in g.get("version_floors", [])],
                )
                for g in data["groups"]
            ]
            return cls(int(data["step"]), groups, list(data["sample_ids"]), data.get("rng", {}))
        except (KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a commit record: {exc}") from exc


def capture_rng() -> dict[str, Any]:
    """The RNG states a step starts from (torch CPU generator and Python's `random`)."""
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
    }


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the RNG states `capture_rng` recorded; {} leaves them as they are."""
    if "torch" in rng:
        raw = bytearray(base64.b64decode(rng["torch"]))
        torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
    if "python" in rng:
        random.setstate(_tupled(rng["python"]))


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


class CommitLog:
    """Append-only JSONL of `CommitRecord`s in `root/commits.jsonl`.

    Args:
        root: the checkpoint folder.
    """

    def __init__(self, root: Path):
        self.path = Path(root) / FILE

    def append(self, record: CommitRecord) -> None:
        """Write one record and fsync it: the step is committed when this returns.

        Raises:
            OSError: the disk refused the write (the step is then not committed).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(record.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[CommitRecord]:
        """Every readable record in file order. A torn last line (a crash mid-write) is
        ignored with a warning: that step was never committed."""
        if not self.path.is_file():
            return []
        out = []
        lines = self.path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(CommitRecord.from_json(line))
            except ValueError as exc:
                level = log.warning if number == len(lines) else log.error
                level("%s:%d: skipped (%s)", self.path, number, exc)
        return out

    def after(self, step: int) -> list[CommitRecord]:
        """Records of steps after `step`, in step order; a step recorded twice (trained again
        after a crash) counts once, by its last record."""
        by_step = {r.step: r for r in self.records() if r.step > step}
        return [by_step[k] for k in sorted(by_step)]

    def truncate(self, step: int) -> None:
        """Keep only the records after `step` (atomic rewrite)."""
        kept = self.after(step)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as f:
            f.writelines(r.to_json() + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
