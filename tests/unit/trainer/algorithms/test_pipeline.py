"""The composition around the trainer step: input contract, dynamic sampling, batch-stage
weights (gradient accumulation stays exact), regularizer terms, and the recipes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from flywheel.core.settings import TrainerSettings, load_settings
from flywheel.core.trainer_settings import AlgorithmSettings, OptimSettings
from flywheel.trainer.algorithms import pipeline
from flywheel.trainer.algorithms.losses import normalizer_for
from flywheel.trainer.algorithms.pipeline import AlgoConfig, keep_groups_with_spread, needs
from flywheel.trainer.step import StepConfig, accumulate, build_optimizer, prepare_batch, train_step

from ..factories import make_sample, tiny_model
from ..factories import step_config as replaced

RECIPES = sorted((Path(__file__).parents[4] / "recipes").glob("*.toml"))


def groups(rewards_per_group=((1.0, 0.0, 1.0, 0.0), (1.0, 1.0, 1.0, 1.0))):
    out, i = [], 0
    for g, rewards in enumerate(rewards_per_group):
        group = []
        for r in rewards:
            group.append(
                make_sample(
                    prompt_len=3,
                    completion_len=3 + i % 3,
                    reward=r,
                    logprob=-4.0 - 0.1 * i,
                    seed=i,
                    group_id=f"g{g}",
                )
            )
            i += 1
        out.append(group)
    return out


def step_config(**algorithm) -> StepConfig:
    """The step config of `[trainer.algorithm]` fields `algorithm` (clip-higher 0.2 / 0.28),
    with small logprob chunks."""
    return replaced(
        algorithm={"clip_eps_low": 0.2, "clip_eps_high": 0.28} | algorithm,
        batch={"logprob_chunk_tokens": 4},
    )


def algo(**algorithm) -> AlgoConfig:
    return AlgoConfig(AlgorithmSettings(**algorithm))


def test_needs_unions_the_declared_inputs():
    assert "entropy_BT" in needs(["high_entropy_only"])
    assert "entropy_BT" not in needs(["grpo", "uncertainty_shaping"])
    assert algo(token_weights=["d3s"]).needs_entropy_pass
    assert not algo(token_weights=["nat"]).needs_entropy_pass
    assert algo(advantage="zero_variance").late_advantage


def test_every_catalog_part_has_its_inputs_provided_by_the_step():
    from flywheel.core.algorithm_catalog import CATALOG

    assert {
        row.name: needs([row.name]) - pipeline.STEP_INPUTS
        for row in CATALOG
        if needs([row.name]) - pipeline.STEP_INPUTS
    } == {}


def test_a_part_whose_input_the_step_lacks_is_refused_at_start_up(monkeypatch):
    monkeypatch.setattr(pipeline, "STEP_INPUTS", pipeline.STEP_INPUTS - {"step_rewards_BT"})
    with pytest.raises(ValueError, match="step_rewards_BT"):
        algo(advantage="segment").check()
    algo(advantage="grpo").check()


@pytest.mark.parametrize(
    "settings,known",
    [
        (
            {
                "token_weights": ["high_entropy_only"],
                "params": {"high_entropy_only": {"top_frac_typo": 0.1}},
            },
            "top_frac",
        ),
        ({"advantage": "rlsd", "params": {"rlsd": {"betta": 1.0}}}, "beta"),
        ({"policy_loss": "cppo", "params": {"cppo": {"budget": 1.0}}}, "prefix_budget"),
        ({"regularizers": {"grsp": 0.1}, "params": {"grsp": {"scale": "big"}}}, "scale"),
    ],
)
def test_bad_part_parameter_is_refused_at_start_up(settings, known):
    with pytest.raises(ValueError, match=known):
        StepConfig.from_settings(TrainerSettings(algorithm=settings))


def test_dynamic_sampling_drops_groups_without_reward_spread():
    gs = groups(((1.0, 0.0), (1.0, 1.0), (0.0, 0.0), (0.5, 1.0)))
    kept, treat, dropped = keep_groups_with_spread(
        gs, ["a", "b", "c", "d", "e", "f", "g", "h"], 1e-3
    )
    assert [g[0].group_id for g in kept] == ["g0", "g3"]
    assert treat == ["a", "b", "g", "h"] and dropped == 4


def test_dynamic_sampling_keeps_everything_when_every_group_is_flat():
    gs = groups(((1.0, 1.0), (0.0, 0.0)))
    kept, treat, dropped = keep_groups_with_spread(gs, None, 1e-3)
    assert len(kept) == 2 and treat is None and dropped == 0


def test_dynamic_sampling_in_prepare_batch_counts_dropped_samples():
    batch, metrics = prepare_batch(groups(), step_config(dynamic_sampling=True))
    assert batch.size == 4 and metrics["samples/dropped_zero_variance"] == 4.0


def test_entropy_pass_runs_only_when_a_selected_part_needs_it(monkeypatch):
    calls = []
    real = pipeline.scoring_pass
    monkeypatch.setattr(pipeline, "scoring_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model(seed=1)
    opt = build_optimizer(model, OptimSettings(lr=1e-3))
    for algo, expected in [
        ({}, 0),
        ({"token_weights": ("nat",)}, 0),
        ({"token_weights": ("high_entropy_only",)}, 1),
    ]:
        cfg = step_config(**algo)
        batch, _ = prepare_batch(groups(), cfg)
        calls.clear()
        pipeline.batch_stage(model, opt, batch, cfg)
        assert len(calls) == expected, algo


def test_high_entropy_weights_use_the_policy_entropy_and_drop_80_percent():
    model = tiny_model(seed=1)
    cfg = step_config(token_weights=("high_entropy_only",))
    batch, _ = prepare_batch(groups(), cfg)
    opt = build_optimizer(model, OptimSettings(lr=1e-3))
    new, metrics = pipeline.batch_stage(model, opt, batch, cfg)
    entropy_BT = pipeline.scoring_pass(model, batch, cfg)
    tau = metrics["weight/high_entropy_only/threshold"]
    keep_BT = batch.loss_mask_BT & (entropy_BT >= tau)
    assert_close(new.advantages_BT, torch.where(keep_BT, batch.advantages_BT, 0.0))
    kept = int(keep_BT.sum())
    assert 0 < kept <= 0.2 * int(batch.loss_mask_BT.sum()) + 1


@pytest.mark.parametrize(
    "algo",
    [
        {"token_weights": ("high_entropy_only", "balanced")},
        {"advantage": "zero_variance"},
        {"regularizers": {"k3": 0.1, "entropy_bonus_sampled": 0.01}},
        {"regularizers": {"simko": 0.5, "lp_reg": 0.5}},
    ],
)
def test_gradient_accumulation_equals_one_big_batch_with_algorithm_parts(algo):
    grads = []
    for micro in (8, 3):
        model = tiny_model(seed=2)
        opt = build_optimizer(model, OptimSettings(lr=1e-3))
        cfg = replaced(step_config(**algo), batch={"micro_batch_size": micro})
        batch, _ = prepare_batch(groups(), cfg)
        batch, _ = pipeline.batch_stage(model, opt, batch, cfg)
        accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_zero_variance_gives_the_all_correct_group_a_signal():
    model = tiny_model(seed=1)
    cfg = step_config(advantage="zero_variance")
    batch, _ = prepare_batch(groups(), cfg)
    assert float(batch.advantages_BT[4:].abs().sum()) == 0.0  # left to batch_stage: 0 until then
    new, metrics = pipeline.batch_stage(model, build_optimizer(model, OptimSettings()), batch, cfg)
    assert float(new.advantages_BT[4:].min()) >= 0.0 and float(new.advantages_BT[4:].max()) > 0
    assert metrics["adv/zvp_frac"] == pytest.approx(0.5)


def test_regularizer_terms_enter_the_loss():
    model = tiny_model(seed=2)
    batch, _ = prepare_batch(groups(), step_config())
    plain = accumulate(model, batch, step_config(), normalizer_for(batch.loss_mask_BT))
    model.zero_grad()
    reg = accumulate(
        model, batch, step_config(regularizers={"k1": 1.0}), normalizer_for(batch.loss_mask_BT)
    )
    # k1 = logp - logp_rollout per token, token-mean aggregated
    assert reg.terms["reg"] != 0.0 and plain.terms.get("reg") is None
    assert reg.loss == pytest.approx(plain.loss + reg.terms["reg"], rel=1e-5)


def test_student_topk_matches_the_full_distribution_and_only_runs_when_needed():
    model = tiny_model(seed=2)
    batch, _ = prepare_batch(groups(), step_config())
    assert pipeline.student_topk(model, batch, step_config()) is None
    cfg = step_config(regularizers={"lp_reg": 1.0})
    out = pipeline.student_topk(model, batch, cfg)
    assert out.at_teacher_BTK is None  # no part reads the teacher's top-k
    top_BTK = out.topk_BTK
    logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    full = torch.log_softmax(logits[0, 3].float() / batch.temperature_B[0], dim=-1)
    assert_close(top_BTK[0, 4], full.topk(pipeline.TOPK).values)  # token 4 drawn from pos 3
    assert float(top_BTK.detach()[0, :3].abs().sum()) == 0.0  # prompt positions
    assert top_BTK.requires_grad


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {
        "grpo",
        "dapo",
        "grpo_high_entropy",
        "gspo",
        "opd_rl",
        "rlsd",
        "rlcsd",
        "opd_topk",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_selects_only_parts_whose_inputs_the_step_provides(recipe):
    settings = load_settings(recipe)
    t = settings.trainer
    a = t.algorithm
    parts = [*AlgoConfig(a).selected(), a.loss_aggregation, a.rollout_correction]
    inputs = needs(parts)
    assert inputs <= pipeline.STEP_INPUTS, sorted(inputs - pipeline.STEP_INPUTS)
    # inputs that only the teacher service writes need it on (top-k: with top_k > 0)
    if inputs & {"teacher_logprobs_BT", "wrong_hint_logprobs_BT", "teacher_topk_logprobs_BTK"}:
        assert settings.teacher.enabled, recipe.stem
    if "teacher_topk_logprobs_BTK" in inputs:
        assert settings.teacher.top_k > 0, recipe.stem


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_builds_its_parts_and_takes_a_step(recipe):
    settings = load_settings(recipe)
    cfg = replaced(StepConfig.from_settings(settings.trainer), batch={"logprob_chunk_tokens": 4})
    model = tiny_model(seed=0)
    opt = build_optimizer(model, settings.trainer.optim)
    gs = groups()
    for i, sample in enumerate(s for g in gs for s in g):  # what the teacher service writes
        completion = len(sample.token_ids) - 3
        sample.teacher_logprobs.extend([0.0] * 3 + [-3.0 - 0.2 * (i % 3)] * completion)
        sample.wrong_hint_logprobs.extend([0.0] * 3 + [-3.5 + 0.1 * (i % 2)] * completion)
        sample.teacher_topk = 2
        sample.teacher_topk_ids.extend([0, 0] * 3 + [5, 9] * completion)
        sample.teacher_topk_logprobs.extend([0.0, 0.0] * 3 + [-0.7, -1.2] * completion)
    batch, _ = prepare_batch(gs, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(model, opt, batch, cfg)
    assert result.skipped == ""
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def spy_estimators(monkeypatch, names):
    """Record every call of the registry's estimators `names`."""
    from flywheel.trainer.algorithms.advantages import ADVANTAGES

    calls: list[str] = []
    for name in names:
        real = ADVANTAGES[name]

        def spy(inputs, cfg, real=real, name=name):
            calls.append(name)
            return real(inputs, cfg)

        monkeypatch.setitem(ADVANTAGES, name, spy)
    return calls


def test_a_late_estimator_is_computed_once_where_entropy_exists(monkeypatch):
    from flywheel.trainer.algorithms.advantages import AdvantageConfig
    from flywheel.trainer.algorithms.advantages_token import zero_variance

    calls = spy_estimators(monkeypatch, ["grpo", "zero_variance"])
    model = tiny_model(seed=1)
    cfg = step_config(advantage="zero_variance")
    batch, metrics = prepare_batch(groups(), cfg)
    assert calls == [] and "adv/token_mean" not in metrics  # no GRPO stand-in
    assert float(batch.advantages_BT.abs().sum()) == 0.0
    new, metrics = pipeline.batch_stage(model, build_optimizer(model, OptimSettings()), batch, cfg)
    assert calls == ["zero_variance"]
    # the direct estimator on the whole batch (one group per group_id) with the scored entropy
    entropy_BT = pipeline.scoring_pass(model, batch, cfg)
    inputs = dataclasses.replace(pipeline.advantage_inputs(batch), entropy_BT=entropy_BT)
    direct = zero_variance(inputs, AdvantageConfig(std_floor=cfg.algorithm.std_floor))
    assert_close(new.advantages_BT, torch.where(batch.loss_mask_BT, direct.advantages_BT, 0.0))
    assert "adv/token_mean" in metrics and metrics["adv/zvp_frac"] == pytest.approx(0.5)


def test_grpo_is_computed_once_per_step(monkeypatch):
    calls = spy_estimators(monkeypatch, ["grpo"])
    model = tiny_model(seed=1)
    cfg = step_config(token_weights=("high_entropy_only",))  # batch_stage runs its pass
    batch, _ = prepare_batch(groups(), cfg)
    result = train_step(model, build_optimizer(model, OptimSettings()), batch, cfg)
    assert result.skipped == "" and calls == ["grpo"]


@pytest.mark.parametrize("packed", [False, True])
def test_the_entropy_pass_cuts_the_training_passs_micro_batches(monkeypatch, packed):
    import flywheel.trainer.logprobs as logprobs
    from flywheel.trainer.step import split_micro_batches

    seen: list[tuple[int, int, int]] = []  # rows, width, real tokens of each scored micro-batch
    real = logprobs.selected_token_logprobs

    def spy(model, input_ids_BT, attention_mask_BT, *args, **kwargs):
        rows, width = input_ids_BT.shape
        seen.append((rows, width, int(attention_mask_BT.sum())))
        assert kwargs["packed"] is packed
        return real(model, input_ids_BT, attention_mask_BT, *args, **kwargs)

    model = tiny_model(seed=1)
    cfg = step_config(token_weights=("high_entropy_only",))
    batch, _ = prepare_batch(groups(), cfg)  # 8 rows of 6..8 tokens (3 prompt + 3..5)
    whole = pipeline.scoring_pass(model, batch, cfg)
    budget = replaced(
        cfg, batch={"micro_batch_tokens": 16, "layout": "packed" if packed else "padded"}
    )
    monkeypatch.setattr(logprobs, "selected_token_logprobs", spy)
    entropy_BT = pipeline.scoring_pass(model, batch, budget)
    # padded: rows x longest <= 16 (at most 2 rows of 8); packed: real tokens <= 16
    assert all((tokens if packed else rows * width) <= 16 for rows, width, tokens in seen)
    assert [rows for rows, _, _ in seen] == [mb.size for mb in split_micro_batches(batch, budget)]
    assert len(seen) > 1
    assert_close(entropy_BT, whole, atol=1e-5, rtol=1e-4)  # every row back in its place
