"""Checks shared by the layout tests: two step configs give the same step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.losses import normalizer_for
from flywheel.trainer.step import StepConfig, accumulate, prepare_batch
from flywheel.trainer.weights import load_model


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(model_dir: Path, groups: list, base: StepConfig, other: StepConfig) -> None:
    """`accumulate` of `groups`' batch (cut by `base`) on fresh copies of the model under both
    configs: the same loss (not 0), the same gradient of every parameter and the same token
    statistics, within float rounding."""
    batch, _ = prepare_batch(groups, base)
    norm = normalizer_for(batch.loss_mask_BT)
    results = []
    for cfg in (base, other):
        model = load_model(model_dir)
        acc = accumulate(model, batch, cfg, norm)
        results.append((acc.loss, grads(model), acc.stats.result()))
    (loss_a, grads_a, stats_a), (loss_b, grads_b, stats_b) = results
    assert loss_a != 0.0
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name, grad in grads_a.items():
        assert_close(grads_b[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert stats_b == pytest.approx(stats_a, rel=1e-4, abs=1e-6)
