"""The weight-delta format: the trainer's encoder against the engine's checks, worked examples."""

from __future__ import annotations

import zlib

import pytest
import torch
from safetensors.torch import load_file

from flywheel.core.weight_delta import FULL, GAP, VAL, ZSPARSE, cheapest, sparse_is_smaller
from flywheel.engine.deltas import DeltaRefused, build_result, check_digests, inflate_sparse
from flywheel.trainer.deltas import (
    DeltaWeightsStore,
    byte_planes,
    checksums_of,
    encode_delta,
    tensor_digest,
    with_fillers,
)
from flywheel.trainer.weights import WeightsStore


def test_sparse_or_full_by_bytes():
    # fp32: sparse costs 1 + 4 B per entry, full 4 B per element: numel 10 -> 40 B
    assert sparse_is_smaller(7, 10, 4)  # 35 < 40
    assert not sparse_is_smaller(8, 10, 4)  # 40 = 40: full
    # bf16: 3 B per entry against 2 B per element; 600 of 1000 -> 1800 < 2000
    assert sparse_is_smaller(600, 1000, 2)
    assert not sparse_is_smaller(700, 1000, 2)  # 2100 > 2000


def test_the_cheapest_encoding_by_bytes():
    # bf16, numel 1000 = 2000 B whole; 35 entries = 35 x (1 + 2) = 105 B sparse
    assert cheapest(35, 1000, 2, 40) == "compressed"  # 40 < 105 < 2000
    assert cheapest(35, 1000, 2, 120) == "sparse"  # 105 < 120
    assert cheapest(700, 1000, 2, 2050) == "full"  # 2000 < 2050 < 700 x 3 = 2100
    assert cheapest(700, 1000, 2, 2000) == "full"  # a tie: the whole tensor


def test_byte_planes_group_bytes_by_position():
    # little-endian int16 0x0102 is bytes 02 01, 0x0304 is 04 03: low bytes first, then high
    assert byte_planes(torch.tensor([0x0102, 0x0304], dtype=torch.int16)) == bytes([2, 4, 1, 3])
    # int32 0x0A0B0C0D: one element, its 4 bytes low to high
    assert byte_planes(torch.tensor([0x0A0B0C0D], dtype=torch.int32)) == bytes([13, 12, 11, 10])


def test_one_ulp_steps_compress_to_a_fraction_of_the_sparse_bytes():
    # 10_000 bf16 ones (bits 0x3F80); every 10th element moves one unit in the last place
    # (0x3F81, XOR 0x0001), as an optimizer step moves bf16 weights
    base = {"w": torch.ones(10_000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"].view(torch.int16)[::10] += 1
    entries, stats = encode_delta(base, new)
    assert set(entries) == {"w" + ZSPARSE} and stats.compressed_tensors == 1
    # inflated: 1000 gaps (1, then 10 x 999: indices 0, 10, ..., 9990), the 1000 low XOR bytes
    # (0x01) and the 1000 high ones (0x00): 1000 x (1 + 2) = 3000 bytes, the raw sparse size
    stream = entries["w" + ZSPARSE]
    assert zlib.decompress(stream.numpy().tobytes()) == (
        bytes([1] + [10] * 999) + bytes([1] * 1000) + bytes(1000)
    )
    assert len(stream) < 3000 // 20  # three constant runs: tens of bytes
    idx, xor = inflate_sparse("w", stream, base["w"])
    assert idx.tolist() == list(range(0, 10_000, 10)) and set(xor.tolist()) == {1}
    result, changed = build_result(base, entries)
    assert changed == 1000 and torch.equal(
        result["w"].view(torch.int16), new["w"].view(torch.int16)
    )


def test_engine_refuses_a_broken_compressed_entry():
    live = torch.ones(4, dtype=torch.bfloat16)  # at most 4 x (1 + 2) = 12 inflated bytes

    def refused(payload: bytes, raw: bool = False) -> str:
        data = payload if raw else zlib.compress(payload)
        blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with pytest.raises(DeltaRefused) as err:
            build_result({"w": live}, {"w" + ZSPARSE: blob})
        assert err.value.reason == "invalid"
        return err.value.message

    assert "no zlib stream" in refused(b"not zlib at all", raw=True)
    assert "inflates to 13+ bytes" in refused(bytes([1]) * 20)  # more than 12: cut at 13
    assert "not n x 3" in refused(bytes([1, 1, 0, 0]))  # 4 bytes: no whole number of entries
    assert "outside 0..3" in refused(bytes([5, 1, 0]))  # gap 5 from -1: index 4
    assert "outside 0..3" in refused(bytes([0, 1, 0]))  # a zero gap
    truncated = zlib.compress(bytes([1, 1, 0]))[:-2]  # the Adler-32 check cut off
    assert "inflates to 3+ bytes" in refused(truncated, raw=True)
    with pytest.raises(DeltaRefused, match="comes alone"):
        blob = torch.frombuffer(bytearray(zlib.compress(bytes([1, 1, 0]))), dtype=torch.uint8)
        build_result({"w": live}, {"w" + ZSPARSE: blob, "w" + GAP: blob})


def test_several_deltas_in_a_row_equal_the_last_weights_bit_for_bit():
    # a bf16 "training run": each step moves a random 0.5-100% of the elements of each tensor
    # by 1-2 units in the last place (sparse and compressed entries), the last one draws new
    # random weights (incompressible: whole); applying the deltas one after the other gives the
    # last weights exactly
    g = torch.Generator().manual_seed(0)
    state = {
        "emb": (torch.randn(300, 64, generator=g) * 0.02).to(torch.bfloat16),
        "norm": torch.ones(64, dtype=torch.bfloat16),
    }
    served = {k: v.clone() for k, v in state.items()}
    kinds = set()
    for share in (0.005, 0.03, 0.4, 0.01, 1.0, -1.0):
        new = {}
        for name, t in state.items():
            if share < 0:
                new[name] = torch.randn(t.shape, generator=g).to(torch.bfloat16)
                continue
            moved = t.clone()
            mask = torch.rand(t.shape, generator=g) < share
            step = torch.randint(1, 3, t.shape, generator=g, dtype=torch.int16)
            moved.view(torch.int16)[mask] += step[mask]
            new[name] = moved
        entries, _ = encode_delta(state, new)
        kinds |= {key.rsplit(":", 1)[1] for key in entries}
        result, _ = build_result(served, entries)
        check_digests(served, result, {k: tensor_digest(v) for k, v in new.items()})
        served.update(result)
        state = new
    assert kinds == {"gap", "val", "zsparse", "full"}
    for name, t in state.items():
        assert torch.equal(served[name].view(torch.int16), t.view(torch.int16)), name


def test_gaps_over_255_get_fillers():
    # 600 - (-1) = 601 > 255: fillers at 254 and 509, gaps 255, 255, 91
    assert with_fillers(torch.tensor([600])).tolist() == [254, 509, 600]
    # 259 - 3 = 256: one filler at 258 (gaps 4, 255, 1); 255 apart needs none
    assert with_fillers(torch.tensor([3, 259])).tolist() == [3, 258, 259]
    assert with_fillers(torch.tensor([254, 509])).tolist() == [254, 509]
    # a whole delta over a long stretch: the engine gets the right values back
    base = {"w": torch.zeros(2000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][[0, 1999]] = 1.0
    entries, stats = encode_delta(base, new)
    # 9 entries: raw sparse 9 x 3 = 27 B; zlib of the 27 repetitive bytes is smaller
    inflated = zlib.decompress(entries["w" + ZSPARSE].numpy().tobytes())
    gaps = [1] + [255] * 7 + [214]  # 1 + 7 x 255 + 214 = 2000
    # XOR planes: 0.0 -> 1.0 is 0x0000 -> 0x3F80 at the two real entries, 0 at the fillers
    low, high = [0x80] + [0] * 7 + [0x80], [0x3F] + [0] * 7 + [0x3F]
    assert list(inflated) == gaps + low + high
    assert len(entries["w" + ZSPARSE]) < 27
    result, _ = build_result(base, entries)
    assert torch.equal(result["w"], new["w"]) and stats.changed_elements == 2


def test_encode_then_apply_gives_the_new_weights_bit_for_bit():
    base = {
        "a": torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        "b": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "c": torch.tensor([0.0, 1.0, 2.0, 3.0]),
    }
    new = {k: v.clone() for k, v in base.items()}
    new["a"][5] = 6.5  # 1 of 8 changed: 5 B sparse < 32 B full
    new["b"] += 1.0  # 4 of 4 changed: full
    new["c"][0] = -0.0  # bits differ though -0.0 == 0.0: a change (5 B < 16 B: sparse)
    entries, stats = encode_delta(base, new)
    assert entries["a" + GAP].tolist() == [6] and entries["a" + VAL].tolist() == [6.5]
    assert torch.equal(entries["b" + FULL], new["b"])
    assert entries["c" + GAP].tolist() == [1]
    assert (stats.changed_tensors, stats.full_tensors, stats.changed_elements) == (3, 1, 6)

    result, changed = build_result(base, entries)
    assert changed == 6
    for name in new:
        assert torch.equal(result[name].view(torch.int32), new[name].view(torch.int32)), name
    digests = {name: tensor_digest(t) for name, t in new.items()}
    check_digests(base, result, digests)  # does not raise
    assert base["a"][5] == 6.0  # the served tensors are not touched


def test_engine_refuses_a_wrong_result_dtype_or_index():
    base = {"a": torch.zeros(4, dtype=torch.bfloat16)}
    new = {"a": torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.bfloat16)}
    entries, _ = encode_delta(base, new)
    result, _ = build_result(base, entries)
    wrong = {"a": tensor_digest(torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=torch.bfloat16))}
    with pytest.raises(DeltaRefused) as err:
        check_digests(base, result, wrong)
    assert err.value.reason == "checksum_mismatch"
    with pytest.raises(DeltaRefused) as err:
        check_digests(base, result, {})  # digests must cover every served tensor
    assert err.value.reason == "invalid"
    with pytest.raises(DeltaRefused) as err:
        build_result({"a": torch.zeros(4)}, entries)  # fp32 served, bf16 values
    assert err.value.reason == "invalid"
    with pytest.raises(DeltaRefused) as err:
        build_result(
            base, {"a" + GAP: torch.tensor([5], dtype=torch.uint8), "a" + VAL: new["a"][:1]}
        )
    assert err.value.reason == "invalid"


def test_store_writes_full_first_then_deltas_and_full_on_demand(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    store = DeltaWeightsStore(WeightsStore(tmp_path, source, keep=5))
    v1 = {"w": torch.arange(10, dtype=torch.bfloat16)}
    v2 = {"w": v1["w"].clone()}
    v2["w"][3] = 100
    first = store.write(1, v1)
    assert (first / "model.safetensors").is_file() and (first / "config.json").is_file()
    second = store.write(2, v2)
    assert not (second / "model.safetensors").exists() and not (second / "config.json").exists()
    delta = load_file(second / "delta.safetensors")
    assert delta["w" + GAP].tolist() == [4] and delta["w" + VAL].tolist() == [100.0]
    assert checksums_of(second / "delta.safetensors") == {"w": tensor_digest(v2["w"])}
    store.full_folder(second, 2)
    assert (second / "config.json").is_file()  # a folder an engine can load
    assert torch.equal(load_file(second / "model.safetensors")["w"], v2["w"])
