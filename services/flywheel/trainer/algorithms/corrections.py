"""Train-inference corrections: detached per-token weights against the rollout logprobs.

The rollout engine and the trainer compute slightly different probabilities for the same token
with the same weights (kernels, precision, MoE routing, FP8). A correction turns the per-token
ratio k_t = pi_train(y_t; theta_old) / pi_rollout(y_t; theta_old) into a weight w_t that
multiplies the token's policy loss:

    l'_t = w_t * l_t(ratio against pi_train(theta_old))

so the policy loss' own ratio is taken against the trainer's probabilities (the "decoupled" or
three-policy form) and the train-inference gap is handled by w_t alone. w_t is detached: it
carries no gradient. The step normalizer is unchanged (fixed before the micro-batch loop,
BUG-14), so a dropped token counts in the denominator and contributes 0.

Every correction has the signature `(CorrectionInputs, CorrectionConfig) -> CorrectionOutputs`
and is registered in `CORRECTIONS` under the name `TrainerSettings.rollout_correction` uses
("none" = no correction, today's behaviour). To add one: a function and one registry line, plus
its worked-example test in `tests/unit/trainer/test_corrections.py`.

Shapes: B = sequences, T = tokens, every tensor (B, T) and aligned with `token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flywheel.trainer.algorithms.losses import LOG_RATIO_LIMIT


@dataclass(frozen=True)
class CorrectionInputs:
    train_logprobs_BT: Tensor
    """(B, T) trainer logprob of each token at the weights that sampled it (any grad is
    ignored: the correction detaches it)."""
    rollout_logprobs_BT: Tensor
    """(B, T) logprob of each token as the rollout engine reported it."""
    loss_mask_BT: Tensor
    """(B, T) bool: True on trained tokens. Weights are exactly 0 elsewhere."""


@dataclass(frozen=True)
class CorrectionConfig:
    cap: float = 2.0
    """C of `tis` (weights truncated at C) and `mis` (tokens with k > C dropped). Yao et al. use
    C = 2."""
    low: float = 0.5
    """alpha of `icepop`: tokens with k < alpha are dropped (Ring-1T: 0.5)."""
    high: float = 5.0
    """beta of `icepop`: tokens with k > beta are dropped (Ring-1T: 5.0)."""


@dataclass(frozen=True)
class CorrectionOutputs:
    weights_BT: Tensor
    """(B, T) detached float32 weight of each token's loss; exactly 0 where masked or dropped."""
    token_stats: dict[str, Tensor]
    """(B, T) detached statistics, reduced over loss tokens like `LossOutputs.token_stats`."""


def _ratio(inputs: CorrectionInputs) -> tuple[Tensor, Tensor]:
    """(B, T) detached train/rollout ratio k (1 where masked, never NaN there) and the mask."""
    mask_BT = inputs.loss_mask_BT.bool()
    log_k_BT = (inputs.train_logprobs_BT.detach() - inputs.rollout_logprobs_BT).float()
    log_k_BT = torch.where(mask_BT, log_k_BT, torch.zeros_like(log_k_BT))
    return torch.exp(log_k_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)), mask_BT


def _outputs(weights_BT: Tensor, kept_BT: Tensor, ratio_BT: Tensor) -> CorrectionOutputs:
    weights_BT = torch.where(kept_BT, weights_BT, torch.zeros_like(weights_BT))
    return CorrectionOutputs(
        weights_BT=weights_BT,
        token_stats={
            "correction/weight_mean": weights_BT,
            "correction/dropped_frac": (~kept_BT).float(),
            "correction/ratio/max": ratio_BT,
            "correction/ratio/min": ratio_BT,
        },
    )


def none(inputs: CorrectionInputs, cfg: CorrectionConfig) -> CorrectionOutputs:
    """No correction: w_t = 1 on every loss token (the step then skips the weighting)."""
    ratio_BT, mask_BT = _ratio(inputs)
    return _outputs(torch.ones_like(ratio_BT), mask_BT, ratio_BT)


def tis(inputs: CorrectionInputs, cfg: CorrectionConfig) -> CorrectionOutputs:
    """Truncated importance sampling: w_t = min(k_t, C), detached.

    Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (blog, fengyao.notion.site/off-policy-rl; no arXiv id), default C = 2. Truncation
    bounds the variance a rare token with k >> 1 would add; k < 1 is kept as is.
    """
    ratio_BT, mask_BT = _ratio(inputs)
    return _outputs(ratio_BT.clamp(max=cfg.cap), mask_BT, ratio_BT)


def mis(inputs: CorrectionInputs, cfg: CorrectionConfig) -> CorrectionOutputs:
    """Masked importance sampling: w_t = k_t if k_t <= C else 0 (the token is dropped).

    Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (blog, yingru.notion.site; no arXiv id; token-level MIS), C = 2 as
    for TIS. Unlike `tis`, a token whose trainer probability far exceeds the rollout's is treated as
    a numerical outlier and removed instead of being kept at weight C.
    """
    ratio_BT, mask_BT = _ratio(inputs)
    return _outputs(ratio_BT, mask_BT & (ratio_BT <= cfg.cap), ratio_BT)


def icepop(inputs: CorrectionInputs, cfg: CorrectionConfig) -> CorrectionOutputs:
    """IcePop: w_t = M(k_t) = k_t if alpha <= k_t <= beta else 0 (double-sided masking).

    "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model"
    (Ring-1T), Ling Team 2025, arXiv:2510.18855, section on IcePop: the PPO term of each token is
    multiplied by M(pi_train(theta_old) / pi_infer(theta_old)); alpha = 0.5, beta = 5.0.
    """
    if not 0.0 <= cfg.low <= cfg.high:
        raise ValueError(f"icepop needs 0 <= low <= high, got [{cfg.low}, {cfg.high}]")
    ratio_BT, mask_BT = _ratio(inputs)
    kept_BT = mask_BT & (ratio_BT >= cfg.low) & (ratio_BT <= cfg.high)
    return _outputs(ratio_BT, kept_BT, ratio_BT)


CorrectionFn = Callable[[CorrectionInputs, CorrectionConfig], CorrectionOutputs]

CORRECTIONS: dict[str, CorrectionFn] = {"none": none, "tis": tis, "mis": mis, "icepop": icepop}
"""Train-inference corrections by `TrainerSettings.rollout_correction`."""
