"""Groups of Samples -> one `TrainBatch` with advantages and per-sample staleness treatment.

Group samples (a `group_id`) get the configured group estimator (`StepConfig.advantage`, e.g.
GRPO) over their group; live samples (no `group_id`, each its own group) get the live estimator
(`StepConfig.live_advantage`): `reward` = the sample's reward on every sampled token (a judge's
+1/-1 is already centred), `opd` = the per-token teacher - rollout logprob gap. Both kinds may
share one step. Token-level estimators read the batch's per-token inputs (teacher and wrong-hint
logprobs, step scores; `pipeline.advantage_inputs`). A sample whose "step/<k>" scores cannot be
placed on its turns is trained without them, counted in `samples/step_rewards_unaligned` and
logged.

Shapes: B = samples in the step, T = longest sample; advantages end up (B, T), 0 off the loss
mask.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from flywheel._proto import sample_pb2
from flywheel.trainer.algorithms.advantages import ADVANTAGES, AdvantageConfig
from flywheel.trainer.algorithms.pipeline import advantage_inputs, keep_groups_with_spread
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
        cfg: the `StepConfig` (advantage, live_advantage, std_floor, quantile_k).
        treatments: staleness treatment and loss weight of each sample, in flattened order;
            None = all fresh.

    Returns:
        (batch, advantage metrics: `adv/...` of the group estimator, `adv_live/...` of the live
        one, `adv/token_mean`, `adv/token_std`, `samples/live`, `samples/is_corrected`,
        `samples/downweighted`).
    """
    dropped_zero_variance = 0
    if cfg.algo.dynamic_sampling:
        groups, treatments, dropped_zero_variance = keep_groups_with_spread(
            groups, treatments, cfg.std_floor
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
    if grouped_N.numel():
        adv_BT[grouped_N], out = _estimate(
            cfg.algo.prepare_advantage, batch, rewards_B, group_index_B, grouped_N, cfg
        )
        metrics |= out
    live_N = live_B.nonzero(as_tuple=True)[0]
    if live_N.numel():
        if cfg.live_advantage == "opd":
            adv_BT[live_N], out = _estimate("opd", batch, rewards_B, group_index_B, live_N, cfg)
        else:  # reward: A = r on every sampled token
            adv_BT[live_N] = rewards_B[live_N].float()[:, None].expand(-1, adv_BT.shape[1])
            out = {"adv/mean": float(rewards_B[live_N].mean())}
        metrics |= {k.replace("adv/", "adv_live/", 1): v for k, v in out.items()}
    adv_BT = torch.where(batch.loss_mask_BT, adv_BT, 0.0)
    selected = adv_BT[batch.loss_mask_BT].double()
    metrics["adv/token_mean"] = float(selected.mean()) if selected.numel() else 0.0
    metrics["adv/token_std"] = float(selected.std()) if selected.numel() > 1 else 0.0
    return dataclasses.replace(batch, advantages_BT=adv_BT), metrics


def _estimate(
    name: str,
    batch: TrainBatch,
    rewards_B: Tensor,
    group_index_B: Tensor,
    rows_N: Tensor,
    cfg,
) -> tuple[Tensor, dict[str, float]]:
    """(N, T) advantages of rows `rows_N` by estimator `name`, with its metrics."""
    _, groups_N = torch.unique(group_index_B[rows_N], return_inverse=True)
    inputs = dataclasses.replace(
        advantage_inputs(batch, rows_N, groups_N), rewards_B=rewards_B[rows_N]
    )
    out = ADVANTAGES[name](
        inputs,
        AdvantageConfig(
            std_floor=cfg.std_floor, quantile_k=cfg.quantile_k, params=cfg.algo.params.get(name, {})
        ),
    )
    width = batch.old_logprobs_BT.shape[1]
    if out.advantages_BT is not None:
        return out.advantages_BT.float(), out.metrics
    return out.advantages_B.float()[:, None].expand(-1, width), out.metrics


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
