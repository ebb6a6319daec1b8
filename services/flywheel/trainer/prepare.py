"""Groups of Samples -> one `TrainBatch` with advantages and per-sample staleness treatment.

Group samples (a `group_id`) get the configured estimator (`StepConfig.algo.advantage`, e.g.
GRPO) over their group, computed here once; an estimator that reads entropy is computed instead
in `pipeline.batch_stage`, where the entropy is scored (their advantages stay 0 until then).
Live samples (no `group_id`, each its own group) get the live estimator
(`trainer.algorithm.live_advantage`): `reward` = the sample's reward on every sampled token (a
judge's +1/-1 is already centred), `opd` = the per-token teacher - rollout logprob gap,
`opd_plus_rl` = OpenClaw-RL's combination w_opd * gap + w_rl * r (either term alone when the
turn has only that signal; `algorithms.advantages.live_opd_plus_rl`). Both
kinds may share one step. Token-level estimators read the batch's per-token inputs (teacher and
wrong-hint logprobs, step scores; `pipeline.advantage_inputs`). A sample whose "step/<k>" scores
cannot be placed on its turns is trained without them, counted in
`samples/step_rewards_unaligned` and logged.

Shapes: B = samples in the step, T = longest sample; advantages end up (B, T), 0 off the loss
mask.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from flywheel._proto import sample_pb2
from flywheel.trainer.algorithms.advantages import OPDPlusRLParams, live_opd_plus_rl
from flywheel.trainer.algorithms.pipeline import (
    advantage_inputs,
    advantage_token_stats,
    estimate,
    keep_groups_with_spread,
)
from flywheel.trainer.batch import TrainBatch, collate
from flywheel.trainer.samples import sampled_runs, step_reward_positions
from flywheel.trainer.staleness import Treatment

log = logging.getLogger(__name__)


def prepare_batch(
    groups: Sequence[Sequence[sample_pb2.Sample]],
    cfg,  # StepConfig (imported lazily by step.py; typed loosely to avoid a cycle)
    treatments: Sequence[tuple[Treatment, float]] | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages by group (live samples by the live estimator), then the padded batch.

    Args:
        groups: the step's groups; a sample without `group_id` is treated as live.
        cfg: the `StepConfig` (algo, live_advantage, std_floor).
        treatments: staleness treatment and loss weight of each sample, in flattened order;
            None = all fresh.

    Returns:
        (batch, advantage metrics: `adv/...` of the group estimator, `adv_live/...` of the live
        one, `adv/token_mean`, `adv/token_std` (from `batch_stage` for a late estimator),
        `samples/live`, `samples/is_corrected`, `samples/downweighted`).
    """
    dropped_zero_variance = 0
    if cfg.algorithm.dynamic_sampling:
        groups, treatments, dropped_zero_variance = keep_groups_with_spread(
            groups, treatments, cfg.algorithm.std_floor
        )
    samples_B = [sample for group in groups for sample in group]
    group_index_B = torch.tensor([g for g, group in enumerate(groups) for _ in group])
    live_B = torch.tensor([not s.group_id for s in samples_B], dtype=torch.bool)
    treat = (
        list(treatments) if treatments is not None else [(Treatment.FRESH, 1.0)] * len(samples_B)
    )
    if len(treat) != len(samples_B):
        raise ValueError(f"{len(treat)} treatments for {len(samples_B)} samples")
    batch = collate(
        samples_B,
        torch.zeros(len(samples_B)),
        sample_weight_B=torch.tensor([w for _, w in treat], dtype=torch.float32),
        is_correct_B=torch.tensor([t == Treatment.IS_CORRECT for t, _ in treat]),
        group_index_B=group_index_B,
    )
    rewards_B = torch.tensor([s.reward for s in samples_B], dtype=torch.float64)
    adv_BT = torch.zeros_like(batch.old_logprobs_BT)
    metrics: dict[str, float] = {
        "samples/live": float(live_B.sum()),
        "samples/is_corrected": float(sum(t == Treatment.IS_CORRECT for t, _ in treat)),
        "samples/downweighted": float(sum(t == Treatment.DOWNWEIGHT for t, _ in treat)),
        "samples/dropped_zero_variance": float(dropped_zero_variance),
        "samples/step_rewards_unaligned": float(_unaligned_step_rewards(samples_B)),
    }
    grouped_N = (~live_B).nonzero(as_tuple=True)[0]
    if grouped_N.numel() and not cfg.algo.late_advantage:  # a late one runs in batch_stage
        adv_BT[grouped_N], out = estimate(cfg.algo.advantage, batch, grouped_N, cfg, rewards_B)
        metrics |= out
    live_N = live_B.nonzero(as_tuple=True)[0]
    if live_N.numel():
        if cfg.algorithm.live_advantage == "opd":
            adv_BT[live_N], out = estimate("opd", batch, live_N, cfg, rewards_B)
        elif cfg.algorithm.live_advantage == "opd_plus_rl":
            adv_BT[live_N], out = _live_combined(samples_B, batch, live_N, cfg)
        else:  # reward: A = r on every sampled token
            adv_BT[live_N] = rewards_B[live_N].float()[:, None].expand(-1, adv_BT.shape[1])
            out = {"adv/mean": float(rewards_B[live_N].mean())}
        metrics |= {k.replace("adv/", "adv_live/", 1): v for k, v in out.items()}
    adv_BT = torch.where(batch.loss_mask_BT, adv_BT, 0.0)
    if not cfg.algo.late_advantage:
        metrics |= advantage_token_stats(adv_BT, batch.loss_mask_BT)
    return dataclasses.replace(batch, advantages_BT=adv_BT), metrics


def _live_combined(
    samples_B: Sequence[sample_pb2.Sample], batch: TrainBatch, live_N: torch.Tensor, cfg
) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, T) OpenClaw-RL combined advantages of the live rows `live_N` (`live_opd_plus_rl`)
    and their metrics; a row with neither a judge's reward nor a teacher logprob gets 0 and is
    counted in `adv/no_signal` and logged (admission drops such Samples as `no_reward`, so
    this only catches a Sample whose teacher mask covers none of its loss tokens)."""
    params = cfg.algo.part_params("opd_plus_rl")
    assert isinstance(params, OPDPlusRLParams)
    has_reward_N = torch.tensor([samples_B[i].has_reward for i in live_N.tolist()])
    adv_NT, no_signal_N, out = live_opd_plus_rl(
        advantage_inputs(batch, live_N), has_reward_N, params
    )
    for i in no_signal_N.nonzero(as_tuple=True)[0].tolist():
        log.warning(
            "live sample %s has neither a judge reward nor a teacher logprob on its sampled "
            "tokens; trained with advantage 0",
            samples_B[int(live_N[i])].sample_id,
        )
    return adv_NT, out | {"adv/no_signal": float(no_signal_N.sum())}


def _unaligned_step_rewards(samples_B: Sequence[sample_pb2.Sample]) -> int:
    """Samples whose "step/<k>" scores cannot be placed on their turns (each logged); the batch
    carries no step scores for them (see `samples.step_reward_positions`)."""
    count = 0
    for sample in samples_B:
        if step_reward_positions(sample) is None:
            count += 1
            steps = sorted(k for k in sample.rewards if k.startswith("step/"))
            log.warning(
                "sample %s: step rewards %s cannot be aligned with its %d sampled turns "
                "and %d assistant messages; trained without step scores",
                sample.sample_id,
                steps,
                len(sampled_runs(list(sample.loss_mask))),
                sum(m.role == "assistant" for m in sample.messages),
            )
    return count
