"""The trainer's AdamW is fused on plain CPU tensors and takes the default optimizer's step."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from flywheel.core.trainer_settings import OptimSettings
from flywheel.trainer.step import build_optimizer

from .factories import tiny_model


def test_fused_adamw_takes_the_default_step():
    settings = OptimSettings(lr=1e-2, weight_decay=0.1, state_dtype="float32")
    fused_model, plain_model = tiny_model(seed=3), tiny_model(seed=3)
    fused = build_optimizer(fused_model, settings)
    plain = torch.optim.AdamW(
        plain_model.parameters(), lr=1e-2, betas=settings.betas, weight_decay=0.1
    )
    assert fused.param_groups[0]["fused"] is True
    assert not plain.param_groups[0]["fused"]
    for step in range(3):
        for model in (fused_model, plain_model):
            torch.manual_seed(step)
            ids = torch.randint(0, 128, (2, 9))
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        fused.step()
        plain.step()
    moved = 0.0
    for (name, a), b in zip(fused_model.named_parameters(), plain_model.parameters(), strict=True):
        assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, float((a - tiny_model(seed=3).get_parameter(name)).abs().max()))
    assert moved > 1e-3  # three steps at lr 1e-2 moved the weights (about lr per step)
