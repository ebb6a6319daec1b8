"""The weight-delta format shared by the trainer (writer) and the embedded engine (reader).

A delta turns the weights of `base_version` into those of `weight_version`, both in the engine's
dtype. It is one safetensors file, `delta.safetensors` in the pushed weights folder, holding for
each tensor that changed the cheapest (fewest bytes) of three entries:

* `<name>:gap` + `<name>:val` ("sparse"): the distances between successive changed flat indices
  (uint8, the first counted from -1, so index_i = gap_0 + ... + gap_i - 1; a distance above
  255 is split by filler entries that carry the element's unchanged value) and the new values
  of those elements (the tensor's dtype): (1 + element bytes) per changed element and filler.
* `<name>:zsparse` ("compressed"): one uint8 entry, the zlib stream (RFC 1950) of the same
  gaps followed by the XOR of the old and new bit patterns of those elements, byte planes
  first (byte 0 of every element, then byte 1, ...; little-endian elements). An optimizer step
  moves a bf16 element by one or two units in the last place, so its XOR is 0x0001, 0x0003
  or similar: the planes are nearly constant and the gaps are small numbers, which zlib's
  Huffman stage codes in fewer bits than the 3 bytes per element of the sparse entries
  (bench/README.md, "Delta pushes"). Decompressed length = n x (1 + element bytes) for n
  entries, so n needs no field of its own.
* `<name>:full` (the whole new tensor, element bytes per element), when nothing else is smaller
  (fp32 under Adam: nearly every element changes in its low mantissa bits).

A bitmap of the changed elements (numel / 8 bytes) was left out: it beats one gap byte per
changed element only above 12.5% changed, where the compressed gaps (all 1s) cost nearly
nothing anyway.

Unchanged tensors are absent. Elements compare by their bits, so -0.0 vs 0.0 and NaN payloads
count as changes. The file's metadata (safetensors' string map) holds `format` (= `FORMAT`),
`base_version`, `weight_version`, `checksum` (= `CHECKSUM`) and `checksums`: JSON
{name: hex digest} of every tensor of the *result* (unchanged ones too; a tied alias is listed
once, under its first name), each the xxh3-128 of the tensor's bytes in C order.

The engine applies a delta only when it serves `base_version` and every result tensor's digest
equals the trainer's; otherwise it answers why (`REASONS`) and changes nothing, and the trainer
pushes the full weights instead. Real SGLang servers have no delta route (404): they always get
full pushes.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, ConfigDict

FORMAT = "flywheel-weight-delta/3"
CHECKSUM = "xxh3_128"
DELTA_FILE = "delta.safetensors"
ROUTE = "/update_weights_from_delta"
"""Engine route taking a delta (the embedded engine's extension of SGLang's weight routes)."""

GAP, VAL, FULL, ZSPARSE = ":gap", ":val", ":full", ":zsparse"
"""Suffixes of the entries of one tensor in the delta file."""
MAX_GAP = 255
"""Largest distance one uint8 gap holds; longer ones get filler entries."""
ZLIB_LEVEL = 6
"""zlib's default level, for the `:zsparse` entries."""

Reason = Literal["base_mismatch", "checksum_mismatch", "invalid", "unsupported", "error"]
REASONS: tuple[str, ...] = (
    "base_mismatch",
    "checksum_mismatch",
    "invalid",
    "unsupported",
    "error",
)
"""Why a delta was not applied: the engine serves another version (or a label the trainer did
not write); a result digest differs from the trainer's; the file does not fit the model (names,
shapes, dtypes, indices); the engine has no delta route (SGLang); the call failed (HTTP)."""


class DeltaUpdateRequest(BaseModel):
    """Body of `POST /update_weights_from_delta` (fields named as SGLang's disk update)."""

    model_config = ConfigDict(extra="ignore")

    delta_path: str
    """The delta file, or the folder holding `delta.safetensors`."""
    base_version: str
    """The weight version the delta applies to; the engine must serve exactly this one."""
    weight_version: str
    """The version the engine serves after applying it."""
    abort_all_requests: bool = False
    flush_cache: bool = True


def digest(data: Any) -> str:
    """xxh3-128 hex digest (32 characters) of a bytes-like object (bytes, memoryview, a
    contiguous numpy array)."""
    return xxhash.xxh3_128_hexdigest(data)


def sparse_is_smaller(entries: int, numel: int, element_bytes: int) -> bool:
    """Whether `entries` (gap, value) pairs take fewer bytes than the whole tensor.

    Example (bf16): numel 1000, element 2 B: full = 2000 B; 600 entries = 600 x (1 + 2) =
    1800 B < 2000 -> sparse; 700 entries = 2100 B -> full.
    """
    return entries * (1 + element_bytes) < numel * element_bytes


Encoding = Literal["sparse", "compressed", "full"]


def cheapest(entries: int, numel: int, element_bytes: int, compressed_bytes: int) -> Encoding:
    """The encoding of one changed tensor with the fewest bytes (ties: the simpler one).

    Args:
        entries: gap entries, fillers included; numel: the tensor's elements;
        element_bytes: 2 (bf16) or 4 (fp32); compressed_bytes: length of the zlib stream.

    Example (bf16, numel 1000 = 2000 B full): 35 entries = 35 x 3 = 105 B sparse; a 40 B
    stream -> "compressed"; a 120 B stream -> "sparse"; 700 entries (2100 B) and a 2050 B
    stream -> "full".
    """
    sizes: dict[Encoding, int] = {
        "full": numel * element_bytes,
        "sparse": entries * (1 + element_bytes),
        "compressed": compressed_bytes,
    }
    return min(sizes, key=lambda k: sizes[k])


def metadata(base_version: int | str, version: int | str, checksums: dict[str, str]) -> dict:
    """The safetensors metadata of a delta (all values are strings, as safetensors requires)."""
    return {
        "format": FORMAT,
        "base_version": str(base_version),
        "weight_version": str(version),
        "checksum": CHECKSUM,
        "checksums": json.dumps(checksums, separators=(",", ":")),
    }


def split_key(key: str) -> tuple[str, str]:
    """(tensor name, suffix) of a delta file entry, e.g. ("a.weight", ":gap").

    Raises:
        ValueError: the key ends in none of the suffixes.
    """
    for suffix in (GAP, VAL, FULL, ZSPARSE):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    raise ValueError(f"delta entry {key!r} ends in none of {GAP}, {VAL}, {FULL}, {ZSPARSE}")
