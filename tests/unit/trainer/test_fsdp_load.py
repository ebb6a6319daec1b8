"""The meta-device build and the choice of tensors to read (fsdp_load.py), without ranks: the
2-rank loading itself is tested in tests/integration/test_trainer_fsdp_load.py."""

from __future__ import annotations

import torch

from flywheel.trainer.fsdp_load import empty_model, file_tensor_names, loadable_state
from flywheel.trainer.weights import load_model


def test_empty_model_has_no_storage_but_real_buffers_and_ties(tiny_model_dir):
    model = empty_model(tiny_model_dir)
    full = load_model(tiny_model_dir)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one parameter
    # rotary frequencies computed, not left on meta: theta^(-2i/d) for i < d/2, with head dim
    # d = hidden 64 / 4 heads = 16: 8 of them, the first theta^0 = 1
    for name, buffer in full.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name
    inv_freq = model.get_buffer("model.rotary_emb.inv_freq")
    assert inv_freq.shape == (8,) and float(inv_freq[0]) == 1.0
    assert model.training and model.dtype == torch.float32


def test_loadable_state_reads_a_tied_parameter_once_under_the_files_name(tiny_model_dir):
    model = empty_model(tiny_model_dir)
    names = file_tensor_names(tiny_model_dir)
    assert "lm_head.weight" not in names  # save_pretrained drops the tied head
    state, missing = loadable_state(model, names)
    assert missing == []
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    # every parameter of the 2-layer model once: 9 per layer + embedding + final norm
    assert len(state) == 2 * 9 + 2 == len(list(model.parameters()))


def test_loadable_state_reports_what_the_files_lack(tiny_model_dir):
    model = empty_model(tiny_model_dir)
    names = {n for n in file_tensor_names(tiny_model_dir) if "layers.1.mlp" not in n}
    state, missing = loadable_state(model, names)
    assert sorted(missing) == [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    ]
    assert len(state) == 2 * 9 + 2 - 3
