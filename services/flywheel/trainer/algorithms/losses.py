"""Token policy losses and their aggregation into one scalar.

Policy losses have the signature `(LossInputs, PPOClipConfig) -> LossOutputs` and live in
`POLICY_LOSSES`; aggregations have `(token_loss_BT, loss_mask_BT, LossNormalizer) -> scalar` and
live in `AGGREGATIONS`. Both are pure: no I/O, no logging, no globals. To add a loss: one function
plus one registry line (and its worked-example test).

Shapes: B = sequences in a micro-batch, T = tokens (right-padded). Every per-token tensor is
(B, T) and aligned with `token_ids`: position t holds the logprob/loss of token t.

Gradient accumulation (BUG-14): the normalizer (loss tokens and trainable sequences of the whole
step) is computed once with `normalizer_for` before the micro-batch loop, and every aggregation
divides by it. The sum of the micro-batch losses then equals the full-batch loss exactly, and a
micro-batch without loss tokens contributes exactly 0 (masked positions go through
`torch.where`, so even a NaN there cannot leak).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 20.0
"""|log ratio| is clamped to this before exp, so a far off-policy token cannot overflow."""


@dataclass(frozen=True)
class LossInputs:
    logprobs_BT: Tensor
    """(B, T) current policy logprob of each token at the rollout temperature (with grad)."""
    old_logprobs_BT: Tensor
    """(B, T) rollout (behaviour policy) logprob of each token, as the engine reported it."""
    advantages_BT: Tensor
    """(B, T) advantage of each token."""
    loss_mask_BT: Tensor
    """(B, T) bool: True on sampled tokens that are trained."""
    entropy_BT: Tensor | None = None
    """(B, T) detached predictive entropy (nats); read by `dhpo` with entropy-guided mixing."""


@dataclass(frozen=True)
class PPOClipConfig:
    eps_low: float = 0.2
    """The ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.2
    """The ratio is clipped above at 1 + eps_high (clip-higher when > eps_low)."""
    dual_clip_c: float = 0.0
    """Dual clip: loss of negative-advantage tokens capped at -A * c (c > 1); 0 = off."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the selected loss' own parameters (`[trainer.algorithm_params.<loss>]`)."""


@dataclass(frozen=True)
class LossOutputs:
    token_loss_BT: Tensor
    """(B, T) loss of each token; exactly 0 where the mask is 0."""
    token_stats: dict[str, Tensor]
    """(B, T) detached per-token statistics keyed by metric name. Keys ending in `/max` or `/min`
    reduce by max or min over loss tokens, all others by the mean over loss tokens."""


@dataclass(frozen=True)
class LossNormalizer:
    """Denominators of the whole step batch, fixed before the micro-batch loop."""

    tokens: float
    """Loss tokens in the step batch (at least 1, so an all-masked batch gives loss 0)."""
    sequences: float
    """Sequences with at least one loss token in the step batch (at least 1)."""


def normalizer_for(loss_mask_BT: Tensor) -> LossNormalizer:
    """Denominators from the loss mask of the whole step batch (all micro-batches together)."""
    tokens_B = loss_mask_BT.sum(dim=1)
    return LossNormalizer(
        tokens=max(float(tokens_B.sum()), 1.0),
        sequences=max(float((tokens_B > 0).sum()), 1.0),
    )


def ppo_clip(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """PPO clipped surrogate per token, with asymmetric clip (clip-higher) and optional dual clip.

        r_t     = exp(logp_t - logp_old_t)            (logp_old = rollout logprob)
        l_t     = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
        dual:     l_t = min(l_t, -A_t c)   where A_t < 0   (only when c > 1)

    PPO: Schulman et al. 2017, arXiv:1707.06347. Clip-higher (eps_high > eps_low): DAPO, Yu et
    al. 2025, arXiv:2503.14476. Dual clip: Ye et al. 2020, arXiv:1912.09729. Used with group
    advantages as in GRPO (DeepSeekMath, arXiv:2402.03300).

    Shapes: every input and output is (B, T). Statistics: `clip/frac` (either bound active),
    `clip/frac_low`, `clip/frac_high`, `clip/frac_dual`, `ratio/mean`, `ratio/max`, `ratio/min`,
    and `kl/k3_rollout` = (r - 1) - log r, Schulman's low-variance estimator of
    KL(rollout || current) from rollout samples.
    """
    log_ratio_BT = (inputs.logprobs_BT - inputs.old_logprobs_BT).clamp(
        -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    return _clipped_surrogate(torch.exp(log_ratio_BT), log_ratio_BT, inputs, cfg)


def _clipped_surrogate(
    ratio_BT: Tensor, log_ratio_BT: Tensor, inputs: LossInputs, cfg: PPOClipConfig
) -> LossOutputs:
    """max(-A r, -A clip(r)), dual clip, masking and clip statistics for any (B, T) ratio."""
    mask_BT = inputs.loss_mask_BT.bool()
    adv_BT = inputs.advantages_BT
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = torch.zeros_like(mask_BT)
    if cfg.dual_clip_c > 0:
        cap_BT = -adv_BT * cfg.dual_clip_c
        dual_BT = (adv_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, cap_BT), loss_BT)
    loss_BT = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))

    with torch.no_grad():
        ratio = ratio_BT.detach()
        low_BT = (ratio < 1.0 - cfg.eps_low) & (adv_BT < 0)
        high_BT = (ratio > 1.0 + cfg.eps_high) & (adv_BT > 0)
        stats = {
            "clip/frac": (low_BT | high_BT).float(),
            "clip/frac_low": low_BT.float(),
            "clip/frac_high": high_BT.float(),
            "clip/frac_dual": dual_BT.float(),
            "ratio/mean": ratio,
            "ratio/max": ratio,
            "ratio/min": ratio,
            "kl/k3_rollout": (ratio - 1.0) - log_ratio_BT.detach(),
        }
    return LossOutputs(token_loss_BT=loss_BT, token_stats=stats)


def gspo(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """GSPO: one length-normalized sequence ratio per sequence, shared by its tokens, clipped.

        log s_b   = (1 / |y_b|) sum_t m_bt (logp_bt - logp_old_bt)     (geometric-mean ratio)
        s_bt      = sg[s_b] * exp(logp_bt - sg[logp_bt])               (GSPO-token form)
        l_bt      = max(-A_bt s_bt, -A_bt clip(s_bt, 1 - eps_low, 1 + eps_high))

    "Group Sequence Policy Optimization", Zheng et al. 2025, arXiv:2507.18071, eqs. (5)-(7) and
    GSPO-token (eq. 13). s_bt equals s_b in value, so every token of a sequence is clipped
    together; its gradient is s_b * grad logp_bt, so with a per-sequence advantage and the
    `seq_mean_token_mean` aggregation this is exactly GSPO's sequence objective (the paper's
    normalization: 1/G over sequences, 1/|y| inside). With per-token advantages it is
    GSPO-token. Paper clip ranges are tiny because s is a geometric mean: eps_low = 3e-4,
    eps_high = 4e-4 (set them in the config; the PPO defaults of 0.2 are far looser). Dual clip
    applies as in `ppo_clip` when c > 1.

    Shapes: every input and output is (B, T). If every token of a sequence has the same ratio
    r, then s_b = r and the loss and its gradient equal `ppo_clip`'s for that sequence. Masked
    positions (padding, prompt) never enter |y_b| or the sum, even when they hold NaN.
    """
    mask_BT = inputs.loss_mask_BT.bool()
    diff_BT = inputs.logprobs_BT - inputs.old_logprobs_BT
    diff_BT = torch.where(mask_BT, diff_BT, torch.zeros_like(diff_BT))  # (B, T)
    lengths_B = mask_BT.sum(dim=1).clamp_min(1).to(diff_BT.dtype)
    seq_log_ratio_B = (diff_BT.sum(dim=1) / lengths_B).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    logp_BT = torch.where(mask_BT, inputs.logprobs_BT, torch.zeros_like(inputs.logprobs_BT))
    log_ratio_BT = seq_log_ratio_B.detach()[:, None] + logp_BT - logp_BT.detach()  # (B, T)
    return _clipped_surrogate(torch.exp(log_ratio_BT), log_ratio_BT, inputs, cfg)


def _masked(token_loss_BT: Tensor, loss_mask_BT: Tensor) -> Tensor:
    return torch.where(loss_mask_BT.bool(), token_loss_BT, torch.zeros_like(token_loss_BT))


def token_mean(token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer) -> Tensor:
    """sum_{b,t} m_bt l_bt / N_tokens: every loss token of the step weighs the same.

    DAPO's token-level loss, arXiv:2503.14476 section 3.3.
    """
    return _masked(token_loss_BT, loss_mask_BT).sum() / norm.tokens


def seq_mean_token_mean(
    token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer
) -> Tensor:
    """sum_b [sum_t m_bt l_bt / n_b] / N_sequences: each sequence's token mean, then the mean
    over sequences (the original GRPO objective, arXiv:2402.03300 eq. 3). A sequence without
    loss tokens contributes 0 and is not counted in N_sequences."""
    tokens_B = loss_mask_BT.sum(dim=1).clamp_min(1).to(token_loss_BT.dtype)
    per_seq_B = _masked(token_loss_BT, loss_mask_BT).sum(dim=1) / tokens_B
    return per_seq_B.sum() / norm.sequences


def seq_mean_token_sum(
    token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer
) -> Tensor:
    """sum_{b,t} m_bt l_bt / N_sequences: token sums averaged over sequences, no length division.

    Dr. GRPO, arXiv:2503.20783 section 3.2, divides the token sum by a constant (the generation
    budget) instead of the sequence length; that constant only rescales the gradient, which
    AdamW's normalization absorbs, so it is left out here.
    """
    return _masked(token_loss_BT, loss_mask_BT).sum() / norm.sequences


PolicyLossFn = Callable[[LossInputs, PPOClipConfig], LossOutputs]
AggregationFn = Callable[[Tensor, Tensor, LossNormalizer], Tensor]

POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip, "gspo": gspo}
"""Policy losses by `TrainerSettings.policy_loss`."""

AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
}
"""Aggregations by `TrainerSettings.loss_aggregation`."""
