"""`trainer.gradient_checkpointing = true` trains: the default layout gives way to padded (the
shared-prefix layout needs the KV cache that checkpointing turns off), an explicit
shared_prefix is refused at start, and a checkpointed step has the loss and gradients of the
default one on the real tiny model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from torch.testing import assert_close

from flywheel.core.settings import load_settings
from flywheel.trainer.step import StepConfig, accumulate, normalizer_for, prepare_batch
from flywheel.trainer.weights import load_model, recompute_activations

from .test_shared_prefix import grads, samples


def test_default_layout_gives_way_and_an_explicit_shared_prefix_is_refused():
    assert load_settings().trainer.batch.layout == "shared_prefix"
    assert load_settings(trainer={"gradient_checkpointing": True}).trainer.batch.layout == "padded"
    packed = {"gradient_checkpointing": True, "batch": {"layout": "packed"}}
    assert load_settings(trainer=packed).trainer.batch.layout == "packed"
    with pytest.raises(ValidationError, match='set trainer.batch.layout = "padded"'):
        load_settings(
            trainer={"gradient_checkpointing": True, "batch": {"layout": "shared_prefix"}}
        )


def test_checkpointed_step_equals_the_default_one(tiny_model_dir):
    default = StepConfig.from_settings(load_settings().trainer)
    checkpointed_settings = load_settings(trainer={"gradient_checkpointing": True}).trainer
    checkpointed = StepConfig.from_settings(checkpointed_settings)
    batch, _ = prepare_batch(samples(), default)
    norm = normalizer_for(batch.loss_mask_BT)
    results = []
    for cfg, recompute in ((default, False), (checkpointed, True)):
        model = load_model(tiny_model_dir)
        if recompute:
            recompute_activations(model)
        model.train()
        acc = accumulate(model, batch, cfg, norm)
        results.append((acc.loss, grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a != 0.0 and loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name, grad in grads_a.items():
        assert_close(grads_b[name], grad, atol=1e-5, rtol=1e-4, msg=name)
