"""Worked examples for the train-inference corrections (tis, mis, icepop) and their step wiring."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.core.settings import TrainerSettings
from flywheel.trainer.algorithms.corrections import (
    CORRECTIONS,
    CorrectionConfig,
    CorrectionInputs,
    icepop,
    mis,
    none,
    tis,
)
from flywheel.trainer.algorithms.losses import normalizer_for
from flywheel.trainer.step import StepConfig, accumulate, prepare_batch

from .factories import make_sample, step_config, tiny_model

RATIOS = [0.25, 0.8, 1.5, 3.0, 10.0]
"""k = pi_train / pi_rollout of five trained tokens; a sixth token is masked (NaN logprob)."""


def six_tokens() -> CorrectionInputs:
    train = torch.tensor([[-1.0] * 5 + [float("nan")]], requires_grad=True)
    rollout = torch.tensor([[-1.0 - math.log(k) for k in RATIOS] + [0.0]])
    mask = torch.tensor([[True] * 5 + [False]])
    return CorrectionInputs(train, rollout, mask)


CFG = CorrectionConfig(cap=2.0, low=0.5, high=5.0)


def test_registry():
    assert set(CORRECTIONS) == {"none", "tis", "mis", "icepop"}


@pytest.mark.parametrize(
    ("fn", "expected", "dropped"),
    [
        # none: 1 on every trained token
        (none, [1.0, 1.0, 1.0, 1.0, 1.0], 0),
        # tis: min(k, 2) = 0.25, 0.8, 1.5, min(3, 2) = 2, min(10, 2) = 2
        (tis, [0.25, 0.8, 1.5, 2.0, 2.0], 0),
        # mis: k if k <= 2 else 0 (dropped) = 0.25, 0.8, 1.5, 0, 0
        (mis, [0.25, 0.8, 1.5, 0.0, 0.0], 2),
        # icepop [0.5, 5]: 0.25 < 0.5 dropped, 0.8, 1.5, 3.0 kept as k, 10 > 5 dropped
        (icepop, [0.0, 0.8, 1.5, 3.0, 0.0], 2),
    ],
)
def test_worked_examples(fn, expected, dropped):
    inputs = six_tokens()
    out = fn(inputs, CFG)
    # the masked sixth token always weighs exactly 0, even with a NaN logprob
    assert_close(out.weights_BT, torch.tensor([expected + [0.0]]), atol=1e-5, rtol=1e-5)
    assert not out.weights_BT.requires_grad
    mask = inputs.loss_mask_BT
    assert float(out.token_stats["correction/dropped_frac"][mask].sum()) == dropped
    assert float(out.token_stats["correction/ratio/max"][mask].max()) == pytest.approx(10.0)
    assert torch.isfinite(out.weights_BT).all()


def test_icepop_rejects_inverted_bounds():
    with pytest.raises(ValueError):
        icepop(six_tokens(), CorrectionConfig(low=2.0, high=1.0))


def groups_of_samples():
    lengths = [(3, 5), (6, 2), (4, 3), (2, 4)]
    samples = [
        make_sample(
            prompt_len=p,
            completion_len=c,
            reward=float(i % 2),
            logprob=-5.0 + 0.3 * i,
            temperature=1.0,
            seed=i,
            group_id="g0",
        )
        for i, (p, c) in enumerate(lengths)
    ]
    return [samples]


def grads(cfg: StepConfig) -> dict[str, torch.Tensor]:
    model = tiny_model(seed=1)
    batch, _ = prepare_batch(groups_of_samples(), cfg)
    accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("tis", {"correction_cap": 1e9}),
        ("mis", {"correction_cap": 1e9}),
        ("icepop", {"icepop_bounds": (0.0, 1e9)}),
    ],
)
def test_untruncated_correction_gives_the_plain_importance_sampled_gradient(name, cfg):
    # without clipping, ppo's gradient against the rollout is -A k grad logp; a correction with
    # no truncation gives w = k times the gradient -A grad logp of the ratio against the
    # trainer's own logprobs: the same gradient
    no_clip = {"clip_eps_low": 1e6, "clip_eps_high": 1e6}
    plain = grads(step_config(algorithm=no_clip, batch={"logprob_chunk_tokens": 4}))
    corrected = grads(
        step_config(
            algorithm=no_clip | {"rollout_correction": name} | cfg,
            batch={"logprob_chunk_tokens": 4},
        )
    )
    for key, grad in plain.items():
        assert_close(corrected[key], grad, atol=1e-6, rtol=1e-4, msg=key)


def test_step_config_reads_the_correction_settings():
    default = StepConfig.from_settings(TrainerSettings())
    assert default.correction == "none"
    cfg = StepConfig.from_settings(
        TrainerSettings(
            algorithm={
                "rollout_correction": "icepop",
                "icepop_bounds": (0.2, 3.0),
                "correction_cap": 4.0,
            }
        )
    )
    assert cfg.correction == "icepop"
    assert cfg.correction_cfg == CorrectionConfig(cap=4.0, low=0.2, high=3.0)


@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_gspo_with_a_correction_accumulates_like_one_big_batch(correction):
    # BUG-14 for the new parts: the same grads with 1 micro-batch of 4 or 4 micro-batches of 1
    def run(micro_batch_size):
        return grads(
            step_config(
                algorithm={
                    "policy_loss": "gspo",
                    "loss_aggregation": "seq_mean_token_mean",
                    "rollout_correction": correction,
                    "correction_cap": 1.5,
                },
                batch={"micro_batch_size": micro_batch_size, "logprob_chunk_tokens": 4},
            )
        )

    whole, split = run(4), run(1)
    for key, grad in whole.items():
        assert_close(split[key], grad, atol=1e-6, rtol=1e-4, msg=key)
