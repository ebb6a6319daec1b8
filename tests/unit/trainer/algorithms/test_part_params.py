"""`[trainer.algorithm.params.<part>]`: every registered part either has a parameter dataclass
whose values reach it, or takes none and refuses any; entries for parts that are not selected
are refused. All of it when the settings are turned into the step's config (at start)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from flywheel.core.algorithm_catalog import CATALOG
from flywheel.core.settings import TrainerSettings
from flywheel.core.trainer_settings import OptimSettings
from flywheel.trainer.algorithms import pipeline
from flywheel.trainer.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    normalizer_for,
)
from flywheel.trainer.algorithms.params import NoParams
from flywheel.trainer.step import StepConfig, build_optimizer, prepare_batch, train_step

from ..factories import step_config as replaced
from ..factories import tiny_model
from .test_pipeline import groups


def step_config(**algorithm) -> StepConfig:
    """The checked step config of `[trainer.algorithm]` fields `algorithm`."""
    cfg = StepConfig.from_settings(TrainerSettings(algorithm=algorithm))
    return replaced(cfg, batch={"logprob_chunk_tokens": 4})


def test_every_registered_part_has_a_parameter_class():
    classes = pipeline.param_classes()
    assert set(classes) == {row.name for row in CATALOG}
    assert all(dataclasses.is_dataclass(cls) for cls in classes.values())


@pytest.mark.parametrize(
    "settings,message",
    [
        # advantage: with parameters (a typo) and without any
        (
            {"advantage": "quantile", "params": {"quantile": {"kk": 0.3}}},
            "known: \\['k'\\]",
        ),
        ({"params": {"grpo": {"eps": 1e-6}}}, "'grpo' takes no parameters"),
        ({"params": {"opd_plus_rl": {"rl_weight": 0.5}}}, "not selected"),
        (
            {
                "advantage": "opd_plus_rl",
                "params": {"opd_plus_rl": {"rl_advantage": "opd"}},
            },
            "rl_advantage",
        ),
        # policy loss
        ({"params": {"ppo_clip": {"foo": 1}}}, "'ppo_clip' takes no parameters"),
        ({"policy_loss": "cppo", "params": {"cppo": {"budget": 1.0}}}, "prefix_budget"),
        # token weight
        (
            {
                "token_weights": ["high_entropy_only"],
                "params": {"high_entropy_only": {"frac": 0.1}},
            },
            "top_frac",
        ),
        (
            {"token_weights": ["balanced"], "params": {"balanced": {"x": 1}}},
            "'balanced' takes no parameters",
        ),
        # regularizer (KL estimator, term, and the entropy bonus of entropy_coef)
        ({"regularizers": {"k3": 0.1}, "params": {"k3": {"x": 1}}}, "'k3' takes no"),
        ({"regularizers": {"grsp": 0.1}, "params": {"grsp": {"scal": 2.0}}}, "scale"),
        (
            {"entropy_coef": 0.01, "params": {"entropy_bonus": {"x": 1}}},
            "'entropy_bonus' takes no",
        ),
        # aggregation and correction
        (
            {
                "loss_aggregation": "constant_normalizer",
                "params": {"constant_normalizer": {"kk": 8}},
            },
            "known: \\['k'\\]",
        ),
        (
            {
                "loss_aggregation": "constant_normalizer",
                "params": {"constant_normalizer": {"k": 0}},
            },
            "must be > 0",
        ),
        ({"params": {"token_mean": {"k": 8}}}, "'token_mean' takes no parameters"),
        (
            {"rollout_correction": "tis", "params": {"tis": {"cap": 3.0}}},
            "'tis' takes no",
        ),
    ],
)
def test_bad_or_dropped_parameters_are_refused_at_start(settings, message):
    with pytest.raises(ValueError, match=message):
        StepConfig.from_settings(TrainerSettings(algorithm=settings))


def test_parameters_of_a_part_that_is_not_selected_are_refused_listing_the_selected_ones():
    settings = TrainerSettings(algorithm={"advantage": "grpo", "params": {"quantile": {"k": 0.25}}})
    with pytest.raises(ValueError, match="not selected.*'grpo', 'ppo_clip', 'token_mean', 'none'"):
        StepConfig.from_settings(settings)


def test_advantage_parameter_reaches_the_estimator():
    # group 0 rewards [1, 0, 1, 0]: sorted [0, 0, 1, 1], mean 0.5, std sqrt(1/3) = 0.57735
    #   k = 0.25: Q = 1st sorted = 0 -> A = r / 0.57735 = [1.732051, 0, 1.732051, 0]
    #   k = 0.75: Q = 3rd sorted = 1 -> A = (r - 1) / 0.57735 = [0, -1.732051, 0, -1.732051]
    for k, expected in [(0.25, [1.732051, 0, 1.732051, 0]), (0.75, [0, -1.732051, 0, -1.732051])]:
        cfg = step_config(advantage="quantile", params={"quantile": {"k": k}})
        batch, _ = prepare_batch(groups(), cfg)
        first_token_B = batch.advantages_BT[:4, 3]  # prompt of 3 tokens: token 3 is sampled
        assert_close(first_token_B, torch.tensor(expected), atol=1e-5, rtol=0)


def test_opd_plus_rl_parameters_reach_it_and_its_group_estimator():
    # no teacher logprobs: the OPD gap is 0, so A = rl_weight * A_quantile(k)
    #   group 0 [1, 0, 1, 0], k = 0.25: A_quantile = [1.732051, 0, 1.732051, 0]; x 0.5
    cfg = step_config(
        advantage="opd_plus_rl",
        params={
            "opd_plus_rl": {"rl_weight": 0.5, "rl_advantage": "quantile"},
            "quantile": {"k": 0.25},
        },
    )
    batch, _ = prepare_batch(groups(), cfg)
    assert_close(
        batch.advantages_BT[:4, 3], torch.tensor([0.866025, 0, 0.866025, 0]), atol=1e-5, rtol=0
    )


def test_policy_loss_parameter_reaches_the_loss():
    logp_BT = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    old_BT = torch.tensor([[-1.5, -0.5, -1.5, -0.5]])  # |log r| = 0.5 per token
    inputs = LossInputs(logp_BT, old_BT, torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool))
    losses = {}
    for budget in (10.0, 0.7):
        cfg = step_config(policy_loss="cppo", params={"cppo": {"prefix_budget": budget}})
        losses[budget] = POLICY_LOSSES["cppo"](inputs, cfg.clip).token_loss_BT
    # prefix divergence before token t: 0, 0.5, 1.0, 1.5 -> budget 0.7 masks tokens 2 and 3
    assert bool((losses[10.0][0, 2:] != 0).all())
    assert_close(losses[0.7][0, 2:], torch.zeros(2))
    assert_close(losses[0.7][0, :2], losses[10.0][0, :2])


def test_token_weight_parameter_reaches_the_weight():
    model = tiny_model(seed=1)
    opt = build_optimizer(model, OptimSettings(lr=1e-3))
    kept = {}
    for frac in (0.2, 0.5):
        cfg = step_config(
            token_weights=["high_entropy_only"],
            params={"high_entropy_only": {"top_frac": frac}},
        )
        batch, _ = prepare_batch(groups(((1.0, 0.0, 1.0, 0.0), (1.0, 0.0, 0.0, 0.0))), cfg)
        new, _ = pipeline.batch_stage(model, opt, batch, cfg)
        kept[frac] = int((new.advantages_BT != 0).sum())
    tokens = int(batch.loss_mask_BT.sum())  # 8 samples of 3..5 sampled tokens: 32
    assert kept[0.2] <= 0.2 * tokens + 1 < kept[0.5] <= 0.5 * tokens + 1


def test_regularizer_parameter_reaches_the_term():
    batch, _ = prepare_batch(groups(), step_config())
    lp = SimpleNamespace(
        logprobs_BT=torch.where(batch.loss_mask_BT, -2.0, 0.0), entropy_BT=torch.zeros(8, 8)
    )
    terms = {}
    for scale in (1.0, 3.0):
        cfg = step_config(regularizers={"grsp": 1.0}, params={"grsp": {"scale": scale}})
        terms[scale], _ = pipeline.token_terms(cfg.algo, lp, batch)
    assert float(terms[1.0].abs().sum()) > 0
    assert_close(terms[3.0], 3.0 * terms[1.0])


def test_constant_normalizer_k_is_a_setting():
    # token losses [[1, 2, 9], [3, 9, 9]], mask [[1, 1, 0], [1, 0, 0]]: sum = 1 + 2 + 3 = 6,
    # 2 sequences with loss tokens; k = 4 -> 6 / (2 * 4) = 0.75 (default k = 1024: 6 / 2048)
    loss_BT = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    cfg = step_config(
        loss_aggregation="constant_normalizer", params={"constant_normalizer": {"k": 4}}
    )
    k = cfg.algo.part_params("constant_normalizer").k
    assert k == 4.0
    norm = normalizer_for(mask_BT, constant_k=k)
    assert float(AGGREGATIONS["constant_normalizer"](loss_BT, mask_BT, norm)) == 0.75
    assert step_config().algo.part_params("constant_normalizer").k == 1024.0
    assert isinstance(step_config().algo.part_params("token_mean"), NoParams)


def test_constant_normalizer_k_reaches_the_train_step():
    # the loss is sum / (sequences * k): k = 4 gives twice the loss of k = 8 on the same batch
    losses = {}
    for k in (4, 8):
        cfg = step_config(
            loss_aggregation="constant_normalizer",
            params={"constant_normalizer": {"k": k}},
        )
        model = tiny_model(seed=2)
        batch, _ = prepare_batch(groups(), cfg)
        result = train_step(model, build_optimizer(model, OptimSettings(lr=1e-3)), batch, cfg)
        losses[k] = result.metrics["loss/total"]
    assert losses[8] != 0.0
    assert losses[4] == pytest.approx(2 * losses[8], rel=1e-5)
