"""The weight-delta format: the trainer's encoder against the engine's checks, worked examples."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flywheel.core.weight_delta import FULL, GAP, VAL, sparse_is_smaller
from flywheel.engine.deltas import DeltaRefused, build_result, check_digests
from flywheel.trainer.deltas import (
    DeltaWeightsStore,
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
    assert entries["w" + GAP].tolist() == [1] + [255] * 7 + [214]  # 1 + 7 x 255 + 214 = 2000
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
