"""One optimizer step: groups -> advantages -> batch -> micro-batches -> loss -> backward -> AdamW.

    prepare_batch       advantages by group, then the padded (B, T) batch
    accumulate          per micro-batch: chunked logprobs (fp32) -> [train-inference correction
                        weights] -> policy loss -> aggregation with the step-wide normalizer ->
                        backward; token statistics accumulated
    train_step          non-finite loss or grad norm => skip (grads zeroed, weights and AdamW
                        state untouched, reason logged and returned); else clip and step

Metric keys are slash-namespaced and unit-suffixed where they have a unit (`time/step_s`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from flywheel._proto import sample_pb2
from flywheel.core.settings import TrainerSettings
from flywheel.trainer.algorithms.advantages import ADVANTAGES, AdvantageConfig, AdvantageInputs
from flywheel.trainer.algorithms.corrections import (
    CORRECTIONS,
    CorrectionConfig,
    CorrectionInputs,
)
from flywheel.trainer.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    LossNormalizer,
    PPOClipConfig,
    normalizer_for,
)
from flywheel.trainer.batch import TrainBatch, collate, micro_batches
from flywheel.trainer.logprobs import selected_token_logprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepConfig:
    advantage: str = "grpo"
    std_floor: float = 1e-3
    quantile_k: float = 0.5
    policy_loss: str = "ppo_clip"
    correction: str = "none"
    """Key of CORRECTIONS. Not "none": the policy ratio is taken against the trainer's own
    logprobs at the current weights (detached; equal to pi_train(theta_old) because every
    micro-batch is scored before the single optimizer step) and each token loss is multiplied by
    the correction's detached weight from the trainer/rollout ratio."""
    correction_cfg: CorrectionConfig = field(default_factory=CorrectionConfig)
    aggregation: str = "token_mean"
    clip: PPOClipConfig = field(default_factory=PPOClipConfig)
    micro_batch_size: int = 8
    """Samples per forward/backward pass."""
    max_grad_norm: float = 1.0
    logprob_chunk_tokens: int = 1024

    @classmethod
    def from_settings(cls, s: TrainerSettings) -> StepConfig:
        return cls(
            advantage=s.advantage,
            std_floor=s.std_floor,
            quantile_k=s.quantile_k,
            policy_loss=s.policy_loss,
            correction=s.rollout_correction,
            correction_cfg=CorrectionConfig(
                cap=s.correction_cap, low=s.icepop_bounds[0], high=s.icepop_bounds[1]
            ),
            aggregation=s.loss_aggregation,
            clip=PPOClipConfig(s.clip_eps_low, s.clip_eps_high, s.dual_clip_c),
            micro_batch_size=s.micro_batch_size,
            max_grad_norm=s.max_grad_norm,
            logprob_chunk_tokens=s.logprob_chunk_tokens,
        )


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]
    skipped: str = ""
    """Empty when the optimizer stepped; else why not (`nonfinite_loss`, `nonfinite_grad_norm`,
    `no_loss_tokens`)."""


class TokenStats:
    """Masked per-token statistics accumulated over micro-batches (mean, or `/max`, `/min`)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.tokens = 0

    def add(self, stats: dict[str, Tensor], loss_mask_BT: Tensor) -> None:
        mask_BT = loss_mask_BT.bool()
        n = int(mask_BT.sum())
        if n == 0:
            return
        for name, value_BT in stats.items():
            selected = value_BT.detach()[mask_BT].double()
            if name.endswith("/max"):
                self.values[name] = max(self.values.get(name, -math.inf), float(selected.max()))
            elif name.endswith("/min"):
                self.values[name] = min(self.values.get(name, math.inf), float(selected.min()))
            else:
                self.values[name] = self.values.get(name, 0.0) + float(selected.sum())
        self.tokens += n

    def result(self) -> dict[str, float]:
        return {
            name: value if name.endswith(("/max", "/min")) else value / max(self.tokens, 1)
            for name, value in self.values.items()
        }


def prepare_batch(
    groups: Sequence[Sequence[sample_pb2.Sample]], cfg: StepConfig
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages by group (the configured estimator), then the padded batch of all samples."""
    samples_B = [sample for group in groups for sample in group]
    group_index_B = torch.tensor([g for g, group in enumerate(groups) for _ in group])
    rewards_B = torch.tensor([s.reward for s in samples_B], dtype=torch.float64)
    out = ADVANTAGES[cfg.advantage](
        AdvantageInputs(rewards_B, group_index_B),
        AdvantageConfig(std_floor=cfg.std_floor, quantile_k=cfg.quantile_k),
    )
    return collate(samples_B, out.advantages_B), out.metrics


@dataclass
class Accumulated:
    loss: float = 0.0
    stats: TokenStats = field(default_factory=TokenStats)
    micro_batches: int = 0
    empty_micro_batches: int = 0
    nonfinite: bool = False


def accumulate(
    model: PreTrainedModel, batch: TrainBatch, cfg: StepConfig, norm: LossNormalizer
) -> Accumulated:
    """Forward + backward every micro-batch; grads add up to the full-batch gradient (BUG-14).

    A micro-batch without loss tokens contributes exactly 0 and is skipped (counted). Stops at
    the first non-finite micro-batch loss (`nonfinite`), leaving partial grads for the caller
    to discard.
    """
    acc = Accumulated()
    device = next(model.parameters()).device
    for mb in micro_batches(batch, cfg.micro_batch_size):
        acc.micro_batches += 1
        if not bool(mb.loss_mask_BT.any()):
            acc.empty_micro_batches += 1
            continue
        mb = mb.to(device)
        lp = selected_token_logprobs(
            model, mb.input_ids_BT, mb.attention_mask_BT, mb.temperature_B, mb.loss_mask_BT,
            chunk_tokens=cfg.logprob_chunk_tokens,
        )
        old_logprobs_BT, correction_stats = mb.old_logprobs_BT, {}
        weights_BT: Tensor | None = None
        if cfg.correction != "none":
            corr = CORRECTIONS[cfg.correction](
                CorrectionInputs(lp.logprobs_BT, mb.old_logprobs_BT, mb.loss_mask_BT),
                cfg.correction_cfg,
            )
            old_logprobs_BT = lp.logprobs_BT.detach()
            weights_BT, correction_stats = corr.weights_BT, corr.token_stats
        out = POLICY_LOSSES[cfg.policy_loss](
            LossInputs(lp.logprobs_BT, old_logprobs_BT, mb.advantages_BT, mb.loss_mask_BT),
            cfg.clip,
        )
        token_loss_BT = out.token_loss_BT if weights_BT is None else out.token_loss_BT * weights_BT
        loss = AGGREGATIONS[cfg.aggregation](token_loss_BT, mb.loss_mask_BT, norm)
        if not bool(torch.isfinite(loss)):
            acc.nonfinite = True
            return acc
        loss.backward()
        acc.loss += float(loss.detach())
        gap_BT = (lp.logprobs_BT.detach() - mb.old_logprobs_BT).abs()
        extra = {"entropy/mean": lp.entropy_BT, "logprob/abs_diff_mean": gap_BT}
        acc.stats.add(out.token_stats | correction_stats | extra, mb.loss_mask_BT)
    return acc


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    rewards_B = batch.rewards_B.double()
    return {
        "reward/mean": float(rewards_B.mean()),
        "reward/std": float(rewards_B.std()) if batch.size > 1 else 0.0,
        "reward/min": float(rewards_B.min()),
        "reward/max": float(rewards_B.max()),
        "samples/trained": float(batch.size),
        "tokens/trained": float(batch.loss_mask_BT.sum()),
        "tokens/total": float(batch.attention_mask_BT.sum()),
    }


def train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    cfg: StepConfig,
) -> StepResult:
    """One optimizer step on `batch`, or a logged skip that leaves weights and optimizer as is."""
    t0 = time.perf_counter()
    metrics = batch_metrics(batch)
    optimizer.zero_grad(set_to_none=True)
    if metrics["tokens/trained"] == 0:
        return _skip(optimizer, metrics, "no_loss_tokens", t0)
    acc = accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    t1 = time.perf_counter()
    metrics |= acc.stats.result() | {
        "loss/pg": acc.loss,
        "batch/micro_batches": float(acc.micro_batches),
        "batch/empty_micro_batches": float(acc.empty_micro_batches),
        "time/forward_backward_s": t1 - t0,
    }
    if acc.nonfinite:
        return _skip(optimizer, metrics, "nonfinite_loss", t0)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    metrics["grad/norm"] = grad_norm
    if not math.isfinite(grad_norm):
        return _skip(optimizer, metrics, "nonfinite_grad_norm", t0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    metrics |= {
        "time/optimizer_s": time.perf_counter() - t1,
        "time/step_s": elapsed,
        "tokens/per_s": metrics["tokens/total"] / elapsed,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "step/skipped": 0.0,
    }
    return StepResult(metrics)


def _skip(
    optimizer: torch.optim.Optimizer, metrics: dict[str, float], reason: str, t0: float
) -> StepResult:
    optimizer.zero_grad(set_to_none=True)
    log.warning("optimizer step skipped: %s (weights unchanged); metrics %s", reason, metrics)
    metrics |= {"step/skipped": 1.0, "time/step_s": time.perf_counter() - t0}
    return StepResult(metrics, skipped=reason)


def build_optimizer(model: PreTrainedModel, s: TrainerSettings) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, fp32 state (the model is fp32)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
