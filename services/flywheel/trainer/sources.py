"""Where the trainer's Samples come from: `redis` (the train stream), `replay`, `fake`.

Every source hands out `StreamEntry`s and takes acks and dead letters the same way, so the loop
(service.py) does not know which one it reads:

- `RedisSource` (default): the `trainer` consumer group on the train stream. On its first read
  it takes back the entries still pending under its own consumer name (a restart with a stable
  `trainer.consumer_name`, e.g. a StatefulSet pod name), so they are not left waiting for
  `min_idle_ms`; entries of other, dead consumers come back through XAUTOCLAIM as usual. Either
  way an entry delivered more than `max_deliveries` times (one that stopped the trainer on
  every try) is dead-lettered instead.
- `ReplaySource`: a recorded dump (`SampleDump`) read in order. Entry ids are `<index>-0`
  (index from 1); acks are remembered, and the checkpointed position (first un-acked index)
  makes a resumed replay skip what was already trained.
- `FakeSource`: endless well-formed random groups (`group_size` samples sharing a group_id,
  random 0/1 rewards, random sampled tokens with logprobs in [-3, -0.05]), stamped with the
  trainer's current weight version, so the step can be run and profiled without any service.

`build_source` builds the one `trainer.data.source` names (with the lease keeper of the Redis one).
`SampleDump` is the record/replay format: `.jsonl` (one JSON object per line: `sample_id`,
`group_id`, `reward` for reading, and `payload` = the base64 protobuf bytes) or `.bin`
(repeated 4-byte little-endian length + protobuf bytes). `trainer.data.record_path` appends every
Sample a source hands out, so real traffic can be replayed later.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import redis

from flywheel._proto import sample_pb2
from flywheel.core.codec import decode_sample, encode_sample, new_sample
from flywheel.core.errors import ContractError
from flywheel.core.redis_client import connect
from flywheel.core.streams import ReadReply, StreamConsumer, StreamEntry, default_consumer_name
from flywheel.trainer.leases import LeaseKeeper, NullLeases

if TYPE_CHECKING:
    from flywheel.core.settings import FlywheelSettings
    from flywheel.trainer.weights import Checkpoint

log = logging.getLogger(__name__)

CONSUMER_GROUP = "trainer"
"""The trainer's consumer group on the train stream."""
GONE_CONSUMER_IDLE_MS = 600_000
"""A consumer of the trainer's group idle this long with nothing pending is removed."""


class SampleSource(Protocol):
    """What the trainer loop reads from."""

    kind: str

    def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to `count` entries; waits up to `block_ms` milliseconds when none is ready."""

    def ack(self, entry_ids: list[str]) -> int:
        """Mark entries done (trained or dropped); returns how many were outstanding."""

    def claim(self, entry_ids: list[str]) -> list[StreamEntry] | None:
        """The named entries, still pending, taken over by this reader (for training recorded
        steps again after a crash); entries acked or deleted meanwhile are left out. None =
        this source cannot give entries back by id (its recorded steps are not trained
        again)."""

    def dead_letter(self, entry_id: str, payload: bytes, error: str) -> None:
        """Set an entry aside with its error (and ack it)."""

    def position(self) -> dict[str, Any]:
        """Where the source stands, for the checkpoint (JSON-serializable)."""

    @property
    def exhausted(self) -> bool:
        """No entry will ever come again (a finished replay)."""


class RedisSource:
    """The train stream through a `StreamConsumer` (see module docstring)."""

    kind = "redis"

    def __init__(self, consumer: StreamConsumer):
        self.consumer = consumer
        self._recovered = False

    def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        if not self._recovered:
            self._recovered = True
            self.forget_gone_consumers()
            own = self._own_pending(count)
            if own:
                log.info(
                    "took back %d entries pending under consumer %s",
                    len(own),
                    self.consumer.consumer,
                )
                return own
        return self.consumer.read(count=count, block_ms=block_ms)

    def forget_gone_consumers(self, idle_ms: int = GONE_CONSUMER_IDLE_MS) -> list[str]:
        """Delete the group's other consumers that hold no pending entry and were idle for
        `idle_ms` (earlier trainer processes, e.g. before a restart under a new name): they
        have nothing to lose, and a live one is created again by its next read. Returns the
        names deleted (logged)."""
        c = self.consumer
        gone = []
        consumers: Any = c.client.xinfo_consumers(c.stream, c.group)
        for info in consumers:
            raw = info["name"]
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name != c.consumer and int(info["pending"]) == 0 and int(info["idle"]) >= idle_ms:
                c.client.xgroup_delconsumer(c.stream, c.group, name)
                gone.append(name)
        if gone:
            log.info("removed %d gone consumers without pending entries: %s", len(gone), gone)
        return gone

    def _own_pending(self, count: int) -> list[StreamEntry]:
        c = self.consumer
        reply = c.client.xreadgroup(c.group, c.consumer, {c.stream: "0"}, count=count * 64)
        rows_by_stream = cast(ReadReply, reply or [])
        items = [(eid, fields) for _s, rows in rows_by_stream for eid, fields in rows if fields]
        return c.redelivered(items)  # an entry that crashed the trainer each time goes dead

    def ack(self, entry_ids: list[str]) -> int:
        return self.consumer.ack(entry_ids)

    def claim(self, entry_ids: list[str]) -> list[StreamEntry] | None:
        if not entry_ids:
            return []
        c = self.consumer
        ids: list[Any] = list(entry_ids)
        rows: Any = c.client.xclaim(c.stream, c.group, c.consumer, min_idle_time=0, message_ids=ids)
        return c._to_entries([(eid, fields) for eid, fields in rows or [] if fields])

    def dead_letter(self, entry_id: str, payload: bytes, error: str) -> None:
        self.consumer.dead_letter(entry_id, payload, error)

    def position(self) -> dict[str, Any]:
        c = self.consumer
        last = ""
        try:
            for group in c.client.xinfo_groups(c.stream):
                name = group["name"]
                if (name.decode() if isinstance(name, bytes) else name) == c.group:
                    raw = group["last-delivered-id"]
                    last = raw.decode() if isinstance(raw, bytes) else str(raw)
        except redis.RedisError as exc:  # informational only
            log.warning("could not read the stream position: %s", exc)
        return {
            "kind": self.kind,
            "stream": c.stream,
            "group": c.group,
            "consumer": c.consumer,
            "last_delivered_id": last,
        }

    @property
    def exhausted(self) -> bool:
        return False


class SampleDump:
    """Append-only record of Samples in `.jsonl` or `.bin` (see module docstring).

    Raises:
        ValueError: another suffix.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if self.path.suffix not in (".jsonl", ".bin"):
            raise ValueError(f"sample dump {self.path}: use a .jsonl or .bin file name")

    def append(self, samples: list[sample_pb2.Sample]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            for sample in samples:
                payload = encode_sample(sample)
                if self.path.suffix == ".bin":
                    f.write(struct.pack("<I", len(payload)) + payload)
                else:
                    record = {
                        "sample_id": sample.sample_id,
                        "group_id": sample.group_id,
                        "reward": sample.reward,
                        "payload": base64.b64encode(payload).decode(),
                    }
                    f.write((json.dumps(record) + "\n").encode())

    def __iter__(self) -> Iterator[bytes]:
        """Serialized Samples in file order.

        Raises:
            ContractError: a truncated record or a line without `payload`.
        """
        data = self.path.read_bytes()
        if self.path.suffix == ".bin":
            offset = 0
            while offset < len(data):
                if offset + 4 > len(data):
                    raise ContractError(f"{self.path}: truncated length at byte {offset}")
                (n,) = struct.unpack_from("<I", data, offset)
                if offset + 4 + n > len(data):
                    raise ContractError(f"{self.path}: truncated record at byte {offset}")
                yield data[offset + 4 : offset + 4 + n]
                offset += 4 + n
            return
        for number, line in enumerate(data.decode().splitlines(), 1):
            if line.strip():
                try:
                    yield base64.b64decode(json.loads(line)["payload"])
                except (ValueError, KeyError) as exc:
                    raise ContractError(f"{self.path}:{number}: not a dump record: {exc}") from exc


class ReplaySource:
    """A recorded dump, in order, once (see module docstring).

    Args:
        path: the dump.
        position: index (from 1) of the first entry not yet done, from the checkpoint.
        done: entry ids already acked beyond `position` (from the checkpoint).
    """

    kind = "replay"

    def __init__(self, path: Path | str, position: int = 1, done: list[str] | None = None):
        self.path = Path(path)
        self.payloads = list(SampleDump(path))
        self.acked: set[int] = {_index(e) for e in done or []}
        self.acked.update(range(1, position))
        self.next = position
        self.dead: list[tuple[str, str]] = []
        """(entry id, error) of each dead-lettered entry."""

    def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        out: list[StreamEntry] = []
        while self.next <= len(self.payloads) and len(out) < count:
            index, self.next = self.next, self.next + 1
            if index in self.acked:
                continue
            payload = self.payloads[index - 1]
            entry_id = f"{index}-0"
            try:
                out.append(StreamEntry(entry_id, payload, decode_sample(payload)))
            except ContractError as exc:
                self.dead_letter(entry_id, payload, f"undecodable Sample: {exc}")
        if not out and block_ms:
            time.sleep(min(block_ms, 50) / 1000)
        return out

    def ack(self, entry_ids: list[str]) -> int:
        new = {_index(e) for e in entry_ids} - self.acked
        self.acked |= new
        return len(new)

    def claim(self, entry_ids: list[str]) -> list[StreamEntry] | None:
        out = []
        for entry_id in entry_ids:
            index = _index(entry_id)
            if index in self.acked or not 1 <= index <= len(self.payloads):
                continue
            payload = self.payloads[index - 1]
            out.append(StreamEntry(entry_id, payload, decode_sample(payload)))
        return out

    def dead_letter(self, entry_id: str, payload: bytes, error: str) -> None:
        self.dead.append((entry_id, error))
        self.ack([entry_id])
        log.error("replay entry %s set aside: %s", entry_id, error)

    def position(self) -> dict[str, Any]:
        first = 1
        while first in self.acked:
            first += 1
        return {
            "kind": self.kind,
            "path": str(self.path),
            "position": first,
            "done": [f"{i}-0" for i in sorted(self.acked) if i > first],
        }

    @property
    def exhausted(self) -> bool:
        return self.next > len(self.payloads)


class FakeSource:
    """Endless random well-formed groups (see module docstring).

    Args:
        vocab_size: token ids are drawn from [1, vocab_size).
        group_size: samples per group.
        prompt_tokens, completion_tokens: lengths of each sample.
        version: returns the trainer's weight version (stamped on sampled tokens).
        seed: RNG seed.
    """

    kind = "fake"

    def __init__(
        self,
        vocab_size: int,
        group_size: int,
        prompt_tokens: int,
        completion_tokens: int,
        version: Callable[[], int] = lambda: 0,
        seed: int = 0,
    ):
        self.vocab_size = vocab_size
        self.group_size = group_size
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.version = version
        self.rng = random.Random(seed)
        self.count = 0
        self.acked = 0

    def sample(self, group_id: str) -> sample_pb2.Sample:
        p, c = self.prompt_tokens, self.completion_tokens
        version = self.version()
        sample = new_sample(
            token_ids=[self.rng.randrange(1, self.vocab_size) for _ in range(p + c)],
            loss_mask=[0] * p + [1] * c,
            rollout_logprobs=[0.0] * p + [-self.rng.uniform(0.05, 3.0) for _ in range(c)],
            weight_versions=[-1] * p + [version] * c,
            prompt_length=p,
            group_id=group_id,
            reward=float(self.rng.random() < 0.5),
            has_reward=True,
            mode="episode",
            finish_reason="stop",
        )
        sample.sampling.temperature = 1.0
        return sample

    def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        out: list[StreamEntry] = []
        while len(out) < count:
            group_id = f"fake-{self.count // self.group_size}"
            self.count += 1
            sample = self.sample(group_id)
            out.append(StreamEntry(f"{self.count}-0", encode_sample(sample), sample))
        return out

    def ack(self, entry_ids: list[str]) -> int:
        self.acked += len(entry_ids)
        return len(entry_ids)

    def claim(self, entry_ids: list[str]) -> list[StreamEntry] | None:
        return None  # random Samples are not kept

    def dead_letter(self, entry_id: str, payload: bytes, error: str) -> None:
        log.error("fake entry %s set aside: %s", entry_id, error)

    def position(self) -> dict[str, Any]:
        return {"kind": self.kind, "generated": self.count}

    @property
    def exhausted(self) -> bool:
        return False


class RecordingSource:
    """Wraps a source and appends every entry it hands out to a `SampleDump`."""

    def __init__(self, inner: SampleSource, dump: SampleDump):
        self.inner = inner
        self.dump = dump
        self.kind = inner.kind

    def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        entries = self.inner.read(count, block_ms)
        if entries:
            self.dump.append([e.sample for e in entries])
        return entries

    def ack(self, entry_ids: list[str]) -> int:
        return self.inner.ack(entry_ids)

    def claim(self, entry_ids: list[str]) -> list[StreamEntry] | None:
        return self.inner.claim(entry_ids)  # already recorded when first read

    def dead_letter(self, entry_id: str, payload: bytes, error: str) -> None:
        self.inner.dead_letter(entry_id, payload, error)

    def position(self) -> dict[str, Any]:
        return self.inner.position()

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted


def _index(entry_id: str) -> int:
    return int(entry_id.partition("-")[0])


def build_source(
    settings: FlywheelSettings,
    vocab_size: int,
    latest: Checkpoint | None,
    redis_client: redis.Redis | None = None,
) -> tuple[SampleSource, LeaseKeeper | NullLeases]:
    """The configured source (and its lease keeper), positioned after `latest`."""
    s = settings.trainer
    source: SampleSource
    leases: LeaseKeeper | NullLeases = NullLeases()
    if s.data.source == "redis":
        client = redis_client or connect(settings.redis_url())
        consumer_name = s.consumer_name or default_consumer_name()
        stream = settings.streams.key("train")
        source = RedisSource(
            StreamConsumer.in_deployment(
                client, settings.streams, "train", CONSUMER_GROUP, consumer_name
            )
        )
        interval_s = max(settings.streams.min_idle_ms / 3000, 0.5)
        leases = LeaseKeeper(client, stream, CONSUMER_GROUP, consumer_name, interval_s)
    elif s.data.source == "replay":
        if not s.data.replay_path:
            raise ValueError(
                "trainer.data.source = 'replay' needs trainer.data.replay_path (a dump)"
            )
        position = (latest.state.get("source_position") or {}) if latest else {}
        source = ReplaySource(
            s.data.replay_path, int(position.get("position", 1)), list(position.get("done", []))
        )
    else:
        source = FakeSource(
            vocab_size,
            s.batch.group_size,
            s.data.fake_prompt_tokens,
            s.data.fake_completion_tokens,
            seed=s.seed,
        )
    if s.data.record_path:
        source = RecordingSource(source, SampleDump(s.data.record_path))
    return source, leases
