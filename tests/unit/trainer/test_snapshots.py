"""Deferred snapshots (trainer/snapshots.py): a background write reads the live weights and AdamW
state in place; an optimizer step that begins before the write is published freezes a copy of
what the step is about to change, and the write is done again from that copy, so what gets
published is always the state of the version it was taken at. Real tensors, a real AdamW step
and the real stores."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.trainer.snapshots import (
    DeferredSnapshot,
    SnapshotChanged,
    SnapshotGuard,
    cpu_snapshot,
    deferred_write,
    write_snapshot,
)
from flywheel.trainer.weights import TRAINING_DIR, CheckpointStore, WeightsStore


def _model() -> tuple[LlamaForCausalLM, torch.optim.AdamW]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model: LlamaForCausalLM, optimizer: torch.optim.AdamW) -> None:
    """One real AdamW step (lr 0.1 moves every weight that has a gradient)."""
    ids = torch.tensor([[1, 5, 9, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_write_done_before_the_next_step_reads_the_live_tensors_and_copies_nothing(tmp_path):
    model, optimizer = _model()
    guard = SnapshotGuard(optimizer)
    state = model.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    snapshot = guard.take(state)
    tree, intact = snapshot.read()
    embed = tree["model.embed_tokens.weight"]
    assert embed.data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # no copy
    assert tree["lm_head.weight"].data_ptr() == embed.data_ptr()  # the tie is kept
    store = WeightsStore(tmp_path, tmp_path / "no-source")
    folder = deferred_write(store.write)(1, snapshot)
    assert not snapshot.frozen  # written with no step in between: never copied
    with pytest.raises(RuntimeError, match="released"):
        snapshot.read()  # released once written
    _step(model, optimizer)  # the step after the write changes the live weights, not the file
    saved = load_file(folder / "model.safetensors")
    assert not torch.equal(state["model.norm.weight"], before["model.norm.weight"])
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)


def test_a_step_during_the_write_publishes_the_weights_from_before_the_step(tmp_path):
    model, optimizer = _model()
    _step(model, optimizer)  # version 1
    guard = SnapshotGuard(optimizer)
    version1 = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = guard.take(model.state_dict())
    store = WeightsStore(tmp_path, tmp_path / "no-source")
    writes = []

    def write(version, tree, intact):
        writes.append(tree["model.norm.weight"].data_ptr())
        if len(writes) == 1:  # step 2 begins while version 1 is written: a torn file
            _step(model, optimizer)
        return store.write(version, tree, intact)

    folder = write_snapshot(snapshot, lambda tree, intact: write(1, tree, intact))
    # the first write read the live tensor, the second the copy frozen before step 2
    assert writes[0] == model.get_parameter("model.norm.weight").data_ptr()
    assert writes[1] != writes[0]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v_00000001"]
    saved = load_file(folder / "model.safetensors")
    live = model.state_dict()
    assert not torch.equal(live["model.norm.weight"], version1["model.norm.weight"])
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, version1[name], rtol=0, atol=0)


def test_a_checkpoint_overtaken_by_a_step_keeps_the_adamw_state_of_its_own_step(tmp_path):
    model, optimizer = _model()
    _step(model, optimizer)  # AdamW's step count is 1 for every parameter
    guard = SnapshotGuard(optimizer)
    snapshot = guard.take(
        {"weights": model.state_dict(), "training": {"optimizer": optimizer.state_dict()}}
    )
    store = CheckpointStore(tmp_path, keep=2, source_dir=tmp_path / "no-source")
    calls = []

    def save(tree, intact):
        calls.append(1)
        if len(calls) == 1:
            _step(model, optimizer)  # step 2 changes the moments and the counts mid-write
        return store.save(model, 1, {}, tree["training"], tree["weights"], intact)

    path = write_snapshot(snapshot, save)
    assert len(calls) == 2
    saved = torch.load(path / TRAINING_DIR / "optimizer.pt", weights_only=False)
    assert {float(s["step"]) for s in saved["state"].values()} == {1.0}
    assert {float(s["step"]) for s in optimizer.state_dict()["state"].values()} == {2.0}
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 1
    assert not list(tmp_path.glob(".step_*"))  # the torn attempt left nothing behind


def test_a_store_publishes_nothing_when_the_tensors_changed(tmp_path):
    model, _ = _model()
    store = CheckpointStore(tmp_path, keep=2, source_dir=tmp_path / "no-source")
    with pytest.raises(SnapshotChanged):
        store.save(model, 3, {}, None, None, intact=lambda: False)
    assert list(tmp_path.iterdir()) == []
    weights = WeightsStore(tmp_path, tmp_path / "no-source")
    with pytest.raises(SnapshotChanged):
        weights.write(3, model.state_dict(), intact=lambda: False)
    assert list((tmp_path / "weights").iterdir()) == []


def test_a_frozen_copy_is_freed_once_written_and_the_guard_forgets_the_snapshot(tmp_path):
    model, optimizer = _model()
    guard = SnapshotGuard(optimizer)
    snapshot = guard.take(model.state_dict())
    _step(model, optimizer)  # freezes: the snapshot now holds copies
    assert snapshot.frozen
    tree = snapshot.read()[0]
    copy = weakref.ref(tree["model.norm.weight"])
    assert tree["model.norm.weight"].data_ptr() != model.model.norm.weight.data_ptr()
    del tree
    deferred_write(WeightsStore(tmp_path, tmp_path / "no-source").write)(1, snapshot)
    gc.collect()
    assert copy() is None  # released after the write: no copy outlives it
    del snapshot
    gc.collect()
    assert len(guard._open) == 0


def test_tensors_cast_to_another_dtype_are_copied_at_once():
    model, _ = _model()
    state = model.state_dict()
    tree, _ = DeferredSnapshot(state, torch.bfloat16).read()
    assert tree["model.norm.weight"].dtype == torch.bfloat16
    assert tree["lm_head.weight"] is tree["model.embed_tokens.weight"]  # one copy for the tie
    eager = cpu_snapshot(state)
    assert eager["model.norm.weight"].data_ptr() != state["model.norm.weight"].data_ptr()
    assert eager["lm_head.weight"] is eager["model.embed_tokens.weight"]
