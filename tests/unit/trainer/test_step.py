"""The optimizer step: gradient accumulation equals one big batch (BUG-14), non-finite skips."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.losses import AGGREGATIONS, normalizer_for
from flywheel.trainer.batch import collate
from flywheel.trainer.logprobs import TokenLogprobs
from flywheel.trainer.step import StepConfig, accumulate, prepare_batch, token_loss, train_step

from .factories import make_sample, step_config, tiny_model

LENGTHS = [(3, 5), (6, 2), (4, 0), (2, 0), (5, 7), (3, 1), (7, 4), (2, 3)]
"""(prompt, completion) of 8 samples; samples 2 and 3 have no loss tokens, so with micro-batches
of 2 the second micro-batch is all-masked."""


def groups_of_samples():
    samples = [
        make_sample(
            prompt_len=p,
            completion_len=c,
            reward=float(i % 3),
            logprob=-5.5 + 0.2 * i,
            temperature=[1.0, 0.7][i % 2],
            seed=i,
            group_id=f"g{i // 4}",
        )
        for i, (p, c) in enumerate(LENGTHS)
    ]
    return [samples[:4], samples[4:]]


def config(aggregation="token_mean", micro_batch_size=8) -> StepConfig:
    return step_config(
        algorithm={
            "loss_aggregation": aggregation,
            "clip_eps_low": 0.2,
            "clip_eps_high": 0.28,
            "dual_clip_c": 3.0,
        },
        batch={"micro_batch_size": micro_batch_size, "logprob_chunk_tokens": 4},
    )


def grads_after_accumulate(aggregation, micro_batch_size):
    model = tiny_model(seed=3)
    cfg = config(aggregation, micro_batch_size)
    batch, _ = prepare_batch(groups_of_samples(), cfg)
    acc = accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return acc, grads


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_bug14_grad_accumulation_equals_one_big_batch(aggregation):
    whole, whole_grads = grads_after_accumulate(aggregation, micro_batch_size=8)
    assert whole.micro_batches == 1
    assert whole.stats.result()["clip/frac"] > 0  # the example exercises clipping
    for micro_batch_size, n_micro, n_empty in [(4, 2, 0), (2, 4, 1)]:
        acc, grads = grads_after_accumulate(aggregation, micro_batch_size)
        assert (acc.micro_batches, acc.empty_micro_batches) == (n_micro, n_empty)
        assert acc.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
        for name, grad in grads.items():
            assert_close(grad, whole_grads[name], atol=1e-6, rtol=1e-4, msg=name)
        for name, value in acc.stats.result().items():
            assert value == pytest.approx(whole.stats.result()[name], rel=1e-5, abs=1e-6), name


def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_unchanged(before, model, optimizer):
    weights, opt_state = before
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    after = optimizer.state_dict()["state"]
    assert after.keys() == opt_state["state"].keys()
    for key, state in after.items():
        for name, value in state.items():
            assert torch.equal(value, opt_state["state"][key][name]), (key, name)
    assert all(p.grad is None for p in model.parameters())


def trained_model_and_optimizer():
    model = tiny_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, _ = prepare_batch(groups_of_samples(), config())
    first = train_step(model, optimizer, batch, config(micro_batch_size=4))
    assert not first.skipped
    return model, optimizer, batch


def test_step_updates_weights_and_reports_metrics():
    model = tiny_model(seed=5)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, adv_metrics = prepare_batch(groups_of_samples(), config())
    result = train_step(model, optimizer, batch, config(micro_batch_size=4))
    assert result.skipped == ""
    changed = [n for n, t in model.state_dict().items() if not torch.equal(t, before[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) > 10
    for key in [
        "loss/pg",
        "reward/mean",
        "clip/frac",
        "ratio/mean",
        "ratio/max",
        "kl/k3_rollout",
        "entropy/mean",
        "logprob/abs_diff_mean",
        "grad/norm",
        "time/step_s",
        "tokens/trained",
        "samples/trained",
        "batch/empty_micro_batches",
        "step/skipped",
    ]:
        assert key in result.metrics, key
    assert result.metrics["tokens/trained"] == sum(c for _, c in LENGTHS)
    assert result.metrics["reward/mean"] == pytest.approx(sum(i % 3 for i in range(8)) / 8)
    assert adv_metrics["adv/groups"] == 2


def test_nonfinite_loss_skips_the_step_and_leaves_everything_unchanged():
    model, optimizer, batch = trained_model_and_optimizer()
    before = snapshot(model, optimizer)
    poisoned = dataclasses.replace(
        batch, advantages_BT=torch.where(batch.loss_mask_BT, float("inf"), 0.0)
    )
    result = train_step(model, optimizer, poisoned, config(micro_batch_size=4))
    assert result.skipped == "nonfinite_loss"
    assert result.metrics["step/skipped"] == 1.0
    assert_unchanged(before, model, optimizer)


def test_nonfinite_grad_norm_skips_the_step_and_leaves_everything_unchanged():
    model, optimizer, batch = trained_model_and_optimizer()
    before = snapshot(model, optimizer)
    hook = model.model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    result = train_step(model, optimizer, batch, config(micro_batch_size=4))
    hook.remove()
    assert result.skipped == "nonfinite_grad_norm"
    assert result.metrics["loss/pg"] == result.metrics["loss/pg"]  # the loss itself was finite
    assert_unchanged(before, model, optimizer)


def test_batch_without_loss_tokens_is_skipped():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = snapshot(model, optimizer)
    groups = [[make_sample(completion_len=0, seed=i) for i in range(2)]]
    batch, _ = prepare_batch(groups, config())
    result = train_step(model, optimizer, batch, config())
    assert result.skipped == "no_loss_tokens"
    assert_unchanged(before, model, optimizer)


def test_prepare_batch_spreads_group_advantages_over_loss_tokens():
    # group g0 rewards [1, 0]: grpo A = [+0.7071, -0.7071] on each sample's sampled tokens
    groups = [[make_sample(reward=1.0, seed=1), make_sample(reward=0.0, seed=2)]]
    batch, metrics = prepare_batch(groups, config())
    expected_row0 = torch.tensor([0, 0, 0, 0] + [0.707107] * 4)
    assert_close(batch.advantages_BT[0], expected_row0, atol=1e-5, rtol=0)
    assert_close(batch.advantages_BT[1], -expected_row0, atol=1e-5, rtol=0)
    assert metrics["adv/max_abs"] == pytest.approx(0.707107, abs=1e-5)


def test_token_budget_micro_batches_give_the_same_gradient():
    # micro-batches cut at 24 padded tokens (longest rows first) vs one pass: same loss and grads
    whole, whole_grads = grads_after_accumulate("token_mean", micro_batch_size=8)
    model = tiny_model(seed=3)
    cfg = step_config(config("token_mean", 8), batch={"micro_batch_tokens": 24})
    batch, _ = prepare_batch(groups_of_samples(), cfg)
    acc = accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    assert acc.micro_batches >= 3
    assert acc.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    for name, p in model.named_parameters():
        assert_close(p.grad, whole_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def one_token_batch(rollout_logprob, advantage, *, is_correct=False, weight=1.0):
    sample = make_sample(prompt_len=1, completion_len=1, logprob=rollout_logprob)
    batch = collate(
        [sample],
        torch.tensor([advantage]),
        sample_weight_B=torch.tensor([weight]),
        is_correct_B=torch.tensor([is_correct]),
    )
    return batch


def fixed_logprobs(value):
    logprobs_BT = torch.tensor([[0.0, value]], requires_grad=True)
    return TokenLogprobs(logprobs_BT, torch.tensor([[0.0, 2.0]]))


def test_stale_is_corrected_sample_uses_the_trainer_ratio_and_a_tis_weight():
    # trainer logprob -1.0, rollout -1.5, A = +1, clip 0.2/0.28, tis cap C = 2:
    # plain:        r = e^0.5 = 1.648721, clipped at 1.28 -> loss = max(-1.6487, -1.28) = -1.28
    # IS-corrected: r = 1 (against its own detached logprob), w = min(e^0.5, 2) = 1.648721
    #               -> loss = -1 * 1 * 1.648721 = -1.648721
    cfg = config()
    plain, _ = token_loss(fixed_logprobs(-1.0), one_token_batch(-1.5, 1.0), cfg)
    corrected, stats = token_loss(
        fixed_logprobs(-1.0), one_token_batch(-1.5, 1.0, is_correct=True), cfg
    )
    assert float(plain["pg"][0, 1]) == pytest.approx(-1.28, abs=1e-6)
    assert float(corrected["pg"][0, 1]) == pytest.approx(-1.648721, abs=1e-6)
    assert float(stats["correction/weight_mean"][0, 1]) == pytest.approx(1.648721, abs=1e-6)
    # past the cap: rollout -4.0 -> k = e^3 = 20.09 -> w = 2 -> loss = -2
    capped, _ = token_loss(fixed_logprobs(-1.0), one_token_batch(-4.0, 1.0, is_correct=True), cfg)
    assert float(capped["pg"][0, 1]) == pytest.approx(-2.0, abs=1e-6)


def test_downweighted_sample_scales_its_loss():
    # same token as above with staleness weight 0.25: -1.28 * 0.25 = -0.32
    terms, _ = token_loss(fixed_logprobs(-1.0), one_token_batch(-1.5, 1.0, weight=0.25), config())
    assert float(terms["pg"][0, 1]) == pytest.approx(-0.32, abs=1e-6)


def test_kl_and_entropy_terms_worked_example():
    # logp = -1.0, ref = -1.5: log r = ref - logp = -0.5
    # k1 = 0.5; k2 = 0.125; k3 = e^-0.5 - 1 + 0.5 = 0.106531; kl term = 0.1 * k
    # entropy H = 2.0 (given), coef 0.01 -> entropy term = -0.02
    for estimator, value in [("k1", 0.5), ("k2", 0.125), ("k3", 0.106531)]:
        cfg = step_config(
            config(),
            algorithm={"kl_coef": 0.1, "kl_estimator": estimator, "entropy_coef": 0.01},
        )
        terms, stats = token_loss(
            fixed_logprobs(-1.0), one_token_batch(-1.0, 0.0), cfg, torch.tensor([[0.0, -1.5]])
        )
        assert float(terms["kl"][0, 1]) == pytest.approx(0.1 * value, abs=1e-6), estimator
        assert float(stats[f"kl/ref_{estimator}"][0, 1]) == pytest.approx(value, abs=1e-6)
        assert float(terms["entropy"][0, 1]) == pytest.approx(-0.02, abs=1e-7)
        assert float(terms["pg"][0, 1]) == 0.0  # A = 0


def test_kl_against_an_identical_reference_is_zero_and_leaves_the_k3_gradient_unchanged():
    # ref = pi: k3 = 0 and d k3 / d logp = 1 - e^(ref - logp) = 0, so grads equal plain PPO's
    batch, _ = prepare_batch(groups_of_samples(), config())
    plain_model = tiny_model(seed=3)
    accumulate(plain_model, batch, config(), normalizer_for(batch.loss_mask_BT))
    model, reference = tiny_model(seed=3), tiny_model(seed=3)
    reference.requires_grad_(False)
    cfg = step_config(config(), algorithm={"kl_coef": 0.5, "kl_estimator": "k3"})
    acc = accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT), reference)
    assert acc.terms["kl"] == pytest.approx(0.0, abs=1e-7)
    assert acc.stats.result()["kl/ref_k3"] == pytest.approx(0.0, abs=1e-7)
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters(), strict=True):
        assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert all(p.grad is None for p in reference.parameters())
    with pytest.raises(ValueError, match="reference"):
        accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))


def test_entropy_bonus_changes_the_update_and_reports_its_term():
    batch, _ = prepare_batch(groups_of_samples(), config())
    model = tiny_model(seed=3)
    cfg = step_config(config(), algorithm={"entropy_coef": 0.05})
    acc = accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    entropy = acc.stats.result()["entropy/mean"]
    # token_mean: the term is -0.05 * mean entropy over loss tokens
    assert acc.terms["entropy"] == pytest.approx(-0.05 * entropy, rel=1e-5)
    assert acc.loss == pytest.approx(acc.terms["pg"] + acc.terms["entropy"], rel=1e-6)
    _, plain_grads = grads_after_accumulate("token_mean", 8)
    diff = (model.model.norm.weight.grad - plain_grads["model.norm.weight"]).abs().max()
    assert float(diff) > 1e-6


def test_live_samples_get_their_reward_as_advantage_next_to_a_group():
    # group g0 rewards [1, 0] -> grpo [+0.7071, -0.7071]; live samples (no group_id) with judge
    # rewards +1 and -1 -> advantages +1 and -1 on their sampled tokens
    group = [make_sample(reward=1.0, seed=1), make_sample(reward=0.0, seed=2)]
    live = [
        make_sample(reward=1.0, group_id="", seed=3),
        make_sample(reward=-1.0, group_id="", seed=4),
    ]
    batch, metrics = prepare_batch([group, live[:1], live[1:]], config())
    sampled = batch.loss_mask_BT
    assert batch.advantages_BT[0][sampled[0]].tolist() == pytest.approx([0.707107] * 4, abs=1e-5)
    assert batch.advantages_BT[2][sampled[2]].tolist() == [1.0] * 4
    assert batch.advantages_BT[3][sampled[3]].tolist() == [-1.0] * 4
    assert float(batch.advantages_BT[~sampled].abs().sum()) == 0.0
    assert metrics["samples/live"] == 2 and metrics["adv/groups"] == 1


def test_live_samples_with_opd_get_the_teacher_gap_per_token():
    # teacher logprobs [-0.5, -2.0] on the 2 sampled tokens, rollout -1.0:
    # A_t = teacher - rollout = [+0.5, -1.0]; tokens without a teacher entry get 0
    sample = make_sample(prompt_len=2, completion_len=3, group_id="", logprob=-1.0)
    sample.teacher_logprobs.extend([0.0, 0.0, -0.5, -2.0, 0.0])
    sample.teacher_mask.extend([0, 0, 1, 1, 0])
    cfg = step_config(config(), algorithm={"live_advantage": "opd"})
    batch, metrics = prepare_batch([[sample]], cfg)
    assert batch.advantages_BT[0].tolist() == pytest.approx([0, 0, 0.5, -1.0, 0])
    assert metrics["adv_live/teacher_token_frac"] > 0


def test_scheduler_steps_only_on_committed_steps():
    model = tiny_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
    batch, _ = prepare_batch(groups_of_samples(), config())
    first = train_step(model, optimizer, batch, config(), scheduler=scheduler)
    assert first.metrics["lr"] == pytest.approx(1e-2 * 0.25)
    poisoned = dataclasses.replace(
        batch, advantages_BT=torch.where(batch.loss_mask_BT, float("nan"), 0.0)
    )
    assert train_step(model, optimizer, poisoned, config(), scheduler=scheduler).skipped
    assert scheduler.last_epoch == 1  # the skipped step did not advance the schedule
    second = train_step(model, optimizer, batch, config(), scheduler=scheduler)
    assert second.metrics["lr"] == pytest.approx(1e-2 * 0.5)


def test_bf16_autocast_step_keeps_fp32_master_weights_and_optimizer_state():
    model = tiny_model(seed=5)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = step_config(config(micro_batch_size=4), bf16_autocast=True)
    batch, _ = prepare_batch(groups_of_samples(), cfg)
    result = train_step(model, optimizer, batch, cfg)
    assert result.skipped == ""
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    changed = [n for n, t in model.state_dict().items() if not torch.equal(t, before[n])]
    assert len(changed) > 10
    # the ratio's logprobs are fp32 from the fp32 head: same weights -> ratio close to the
    # fp32 step's (only the bf16 decoder differs)
    plain = tiny_model(seed=5)
    fp32 = train_step(
        plain, torch.optim.AdamW(plain.parameters()), batch, config(micro_batch_size=4)
    )
    assert result.metrics["ratio/mean"] == pytest.approx(fp32.metrics["ratio/mean"], abs=2e-2)
