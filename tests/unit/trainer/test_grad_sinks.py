"""Vocabulary-matrix gradients added into `.grad` in place (grad_sinks.py): the same sums as
autograd's dense temporaries, for the embedding lookup alone and for a whole step."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer import grad_sinks, logprobs, shared_prefix
from flywheel.trainer.algorithms.losses import normalizer_for
from flywheel.trainer.grad_sinks import EmbeddingIntoGrad, ensure_grad_sinks
from flywheel.trainer.step import accumulate, prepare_batch
from flywheel.trainer.weights import load_model

from .factories import make_sample, step_config
from .step_checks import grads


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("existing_grad", [False, True])
def test_embedding_gradient_equals_nn_embedding(padding_idx, existing_grad):
    # ids use row 1 twice and row 2 (the padding row, when set) once: row 1's gradient is the
    # sum of its two output gradients, row 2's is 0 under padding_idx, untouched rows stay 0
    torch.manual_seed(0)
    native = torch.nn.Embedding(5, 3, padding_idx=padding_idx)
    weight = torch.nn.Parameter(native.weight.detach().clone())
    ids = torch.tensor([[1, 2], [1, 4]])
    upstream = torch.randn(2, 2, 3)
    start = torch.randn(5, 3) if existing_grad else None
    if start is not None:
        native.weight.grad = start.clone()
        weight.grad = start.clone()
    (native(ids) * upstream).sum().backward()
    (EmbeddingIntoGrad.apply(ids, weight, padding_idx) * upstream).sum().backward()
    assert_close(weight.grad, native.weight.grad)
    expected_row1 = upstream[0, 0] + upstream[1, 0] + (start[1] if start is not None else 0.0)
    assert_close(weight.grad[1], expected_row1)
    if padding_idx is not None:
        assert_close(weight.grad[2], start[2] if start is not None else torch.zeros(3))


def test_ensure_grad_sinks_makes_zero_grads_once(tiny_model_dir):
    model = load_model(tiny_model_dir)
    embedding = model.get_input_embeddings().weight
    ensure_grad_sinks(model)
    assert embedding.grad is not None and not bool(embedding.grad.any())
    embedding.grad.add_(1.0)
    ensure_grad_sinks(model)  # a grad already there is kept, not zeroed
    assert bool((embedding.grad == 1.0).all())
    embedding.requires_grad_(False)
    embedding.grad = None
    ensure_grad_sinks(model)  # a frozen embedding (LoRA) gets none
    assert embedding.grad is None


def groups():
    prompt = torch.randint(1, 40000, (18,), generator=torch.Generator().manual_seed(3))
    members = []
    for i, completion_len in enumerate([3, 11, 2, 6]):
        sample = make_sample(
            prompt_len=18, completion_len=completion_len, reward=float(i % 2), seed=30 + i
        )
        sample.token_ids[:18] = prompt.tolist()
        members.append(sample)
    return [members]


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefix"])
def test_step_gradients_equal_autograd_dense_ones(tiny_model_dir, monkeypatch, layout):
    # two micro-batches of 2: the second adds into the .grad the first left, on every layout
    cfg = step_config(batch={"micro_batch_size": 2, "layout": layout})
    batch, _ = prepare_batch(groups(), cfg)
    norm = normalizer_for(batch.loss_mask_BT)
    model = load_model(tiny_model_dir)
    acc = accumulate(model, batch, cfg, norm)
    sunk = (acc.loss, grads(model))

    def native(decoder, ids):
        return decoder.get_input_embeddings()(ids)

    for module in (logprobs, shared_prefix):
        monkeypatch.setattr(module, "input_embeddings", native)
    monkeypatch.setattr(grad_sinks, "ensure_grad_sinks", lambda model: None)
    monkeypatch.setattr("flywheel.trainer.step.ensure_grad_sinks", lambda model: None)
    monkeypatch.setattr(logprobs, "adds_into_grad", lambda weight: False)
    model = load_model(tiny_model_dir)
    acc = accumulate(model, batch, cfg, norm)
    dense = (acc.loss, grads(model))
    assert sunk[0] != 0.0 and sunk[0] == pytest.approx(dense[0], rel=1e-6)
    assert sunk[1].keys() == dense[1].keys()
    for name, grad in dense[1].items():
        assert_close(sunk[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
