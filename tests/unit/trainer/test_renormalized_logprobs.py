"""Tokens whose rollout logprob is renormalised over a grammar's allowed tokens
(`Sample.logprob_renormalized`, what an SGLang engine reports under a grammar): the policy ratio
is taken against the trainer's own logprob on them (batch.anchor_renormalized), every other token
keeps the rollout logprob.

The worked example of every test here: at the weights that sampled the token, the model gives it
p(t) = 0.2 over the whole vocabulary; the grammar allows it and one other token of p 0.3, so
the draw was from q(t) = 0.2 / (0.2 + 0.3) = 0.4. SGLang records log q = log 0.4 = -0.916291;
the trainer scores log p = log 0.2 = -1.609438. Against the recorded value the ratio is
exp(-1.609438 + 0.916291) = exp(-0.693147) = 0.5; anchored it is exactly 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.trainer.batch import anchor_renormalized, collate
from flywheel.trainer.logprobs import TokenLogprobs
from flywheel.trainer.step import StepConfig, token_loss, train_step

from .factories import make_sample, step_config, tiny_model

LOG_P = math.log(0.2)  # -1.609438: what the trainer recomputes (no mask)
LOG_Q = math.log(0.4)  # -0.916291: what SGLang recorded (masked, renormalised)


def config(correction: str = "none") -> StepConfig:
    return step_config(
        algorithm={
            "clip_eps_low": 0.2,
            "clip_eps_high": 0.28,
            "dual_clip_c": 3.0,
            "rollout_correction": correction,
        }
    )


def one_token(advantage: float, renormalized: bool):
    """Token 0 is the prompt, token 1 the sampled one with rollout logprob log q."""
    sample = make_sample(prompt_len=1, completion_len=1, logprob=LOG_Q)
    if renormalized:
        sample.logprob_renormalized.extend([0, 1])
    return collate([sample], torch.tensor([advantage]))


def trainer_logprobs() -> TokenLogprobs:
    return TokenLogprobs(torch.tensor([[0.0, LOG_P]], requires_grad=True), torch.zeros(1, 2))


def loss_and_grad(advantage: float, renormalized: bool, cfg: StepConfig):
    lp = trainer_logprobs()
    terms, stats = token_loss(lp, one_token(advantage, renormalized), cfg)
    terms["pg"].sum().backward()
    assert lp.logprobs_BT.grad is not None
    return float(terms["pg"][0, 1].detach()), float(lp.logprobs_BT.grad[0, 1]), stats


def test_collate_marks_only_sampled_tokens_of_samples_that_carry_the_array():
    marked = make_sample(prompt_len=2, completion_len=3, seed=1)
    marked.logprob_renormalized.extend([1, 0, 1, 1, 0])  # a mark on a prompt token is ignored
    plain = make_sample(prompt_len=1, completion_len=2, seed=2)
    batch = collate([marked, plain], torch.zeros(2))
    assert batch.renormalized_BT.tolist() == [
        [False, False, True, True, False],
        [False, False, False, False, False],
    ]


@pytest.mark.parametrize(
    ("advantage", "renormalized", "loss", "grad"),
    [
        # recorded log q: r = 0.5; A = +1: -min(0.5 * 1, clip(0.5, 0.8, 1.28) * 1) = -0.5,
        # d/dlogp = -A r = -0.5 (half the on-policy gradient)
        (1.0, False, -0.5, -0.5),
        # A = -1: -min(-0.5, -0.8) = 0.8 (the clipped term; dual clip min(0.8, 3) = 0.8): no grad
        (-1.0, False, 0.8, 0.0),
        # anchored: r = 1; A = +1: -1, gradient -1; A = -1: +1, gradient +1 (as on-policy)
        (1.0, True, -1.0, -1.0),
        (-1.0, True, 1.0, 1.0),
    ],
)
def test_the_ratio_of_a_renormalised_token_is_taken_against_the_trainer(
    advantage, renormalized, loss, grad
):
    value, gradient, stats = loss_and_grad(advantage, renormalized, config())
    assert value == pytest.approx(loss, abs=1e-6)
    assert gradient == pytest.approx(grad, abs=1e-6)
    # the train-inference gap statistic: |log p - log q| = 0.693147 recorded, 0 anchored
    gap = 0.0 if renormalized else math.log(2.0)
    assert float(stats["logprob/abs_diff/max"][0, 1]) == pytest.approx(gap, abs=1e-6)


def test_a_correction_sees_k_equal_1_on_a_renormalised_token():
    # tis, C = 2: the ratio is taken against the trainer's own logprob (r = 1) and the token is
    # weighted by min(k, C), k = p_train / p_rollout. Recorded log q: k = 0.5 -> loss -0.5;
    # anchored: k = 1 -> loss -1 (the renormalisation is not mistaken for a train-inference gap)
    plain, _, plain_stats = loss_and_grad(1.0, False, config("tis"))
    anchored, _, stats = loss_and_grad(1.0, True, config("tis"))
    assert plain == pytest.approx(-0.5, abs=1e-6)
    assert anchored == pytest.approx(-1.0, abs=1e-6)
    assert float(plain_stats["correction/weight_mean"][0, 1]) == pytest.approx(0.5, abs=1e-6)
    assert float(stats["correction/weight_mean"][0, 1]) == pytest.approx(1.0, abs=1e-6)


def test_anchoring_leaves_other_tokens_and_unmarked_batches_alone():
    sample = make_sample(prompt_len=1, completion_len=3, logprob=LOG_Q)
    sample.logprob_renormalized.extend([0, 0, 1, 0])
    batch = collate([sample], torch.ones(1))
    own_BT = torch.tensor([[-9.0, -1.0, -2.0, -3.0]])
    anchored = anchor_renormalized(batch, own_BT).old_logprobs_BT
    assert anchored[0].tolist() == pytest.approx([0.0, LOG_Q, -2.0, LOG_Q])
    plain = collate([make_sample(prompt_len=1, completion_len=3)], torch.ones(1))
    assert anchor_renormalized(plain, own_BT) is plain


def test_the_step_reports_how_many_tokens_it_anchored():
    samples = [make_sample(prompt_len=2, completion_len=3, seed=s, reward=float(s)) for s in (1, 2)]
    samples[0].logprob_renormalized.extend([0, 0, 1, 1, 1])
    model = tiny_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = collate(samples, torch.tensor([1.0, -1.0]))
    result = train_step(model, optimizer, batch, config())
    assert result.metrics["tokens/logprob_renormalized"] == 3.0
    assert result.metrics["tokens/trained"] == 6.0
