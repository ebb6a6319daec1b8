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

from flywheel.trainer.algorithms.params import NoParams, resolve

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
    """Overrides of the selected loss' own parameters (`[trainer.algorithm.params.<loss>]`)."""


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
    constant_k: float = 1024.0
    """k of `constant_normalizer` (a fixed per-trajectory denominator)."""


def normalizer_for(loss_mask_BT: Tensor, constant_k: float = 1024.0) -> LossNormalizer:
    """Denominators from the loss mask of the whole step batch (all micro-batches together);
    `constant_k` is `constant_normalizer`'s k (`[trainer.algorithm.params.constant_normalizer]`)."""
    tokens_B = loss_mask_BT.sum(dim=1)
    return LossNormalizer(
        tokens=max(float(tokens_B.sum()), 1.0),
        sequences=max(float((tokens_B > 0).sum()), 1.0),
        constant_k=constant_k,
    )


def ppo_clip(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """PPO clipped surrogate per token, with asymmetric clip (clip-higher) and optional dual clip.

        r_t     = exp(logp_t - logp_old_t)            (logp_old = rollout logprob)
        l_t     = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
        dual:     l_t = min(l_t, -A_t c)   where A_t < 0   (only when c > 1)

    PPO: "Proximal Policy Optimization Algorithms", Schulman et al. 2017, arXiv:1707.06347.
    Clip-higher (eps_high > eps_low): "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", Yu et al. 2025, arXiv:2503.14476. Dual clip: "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning", Ye et al. 2020, arXiv:1912.09729. Used with group advantages
    as in GRPO ("DeepSeekMath", arXiv:2402.03300).

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


def _token_log_ratio(inputs: LossInputs) -> Tensor:
    """(B, T) clamped log(pi / pi_old), exactly 0 off the mask (NaN there cannot leak)."""
    mask_BT = inputs.loss_mask_BT.bool()
    diff_BT = inputs.logprobs_BT - inputs.old_logprobs_BT
    diff_BT = torch.where(mask_BT, diff_BT, torch.zeros_like(diff_BT))
    return diff_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _ratio_stats(ratio_BT: Tensor, log_ratio_BT: Tensor) -> dict[str, Tensor]:
    ratio = ratio_BT.detach()
    return {
        "ratio/mean": ratio,
        "ratio/max": ratio,
        "ratio/min": ratio,
        "kl/k3_rollout": (ratio - 1.0) - log_ratio_BT.detach(),
    }


def cispo(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """CISPO: clip the importance-sampling weight, not the token update; every token keeps its
    gradient.

        r_t = exp(logp_t - logp_old_t)
        l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t

    "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", MiniMax 2025,
    arXiv:2506.13585, section 3.1 (eq. 4-5). Unlike PPO, a token whose ratio leaves the trust
    region still contributes A * clip(r) * grad logp (no zero gradient), which keeps rare
    "fork" tokens learning. The paper sets no lower bound in practice (eps_low large) and tunes
    eps_high; use clip_eps_low / clip_eps_high (e.g. 1.0 / 0.28 here for no lower clip).
    Shapes: all (B, T); exactly 0 off the mask.
    """
    mask_BT = inputs.loss_mask_BT.bool()
    log_ratio_BT = _token_log_ratio(inputs)
    ratio_BT = torch.exp(log_ratio_BT).detach()
    weight_BT = ratio_BT.clamp(max(1.0 - cfg.eps_low, 0.0), 1.0 + cfg.eps_high)
    logp_BT = torch.where(mask_BT, inputs.logprobs_BT, torch.zeros_like(inputs.logprobs_BT))
    loss_BT = torch.where(
        mask_BT, -weight_BT * inputs.advantages_BT * logp_BT, torch.zeros_like(logp_BT)
    )
    clipped = (ratio_BT != weight_BT).float()
    return LossOutputs(loss_BT, {"clip/frac": clipped} | _ratio_stats(ratio_BT, log_ratio_BT))


@dataclass(frozen=True)
class DHPOParams:
    mixing: str = "mean"
    """`mean` (w = 1/2) or `entropy` (w_t = H_t / max_t H: high-entropy tokens lean on the
    token ratio, confident ones on the sequence ratio)."""
    seq_eps_low: float = 3e-4
    """Sequence-branch clip range (GSPO's, as the sequence ratio is a geometric mean)."""
    seq_eps_high: float = 4e-4


def dhpo(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """DHPO: mix of the token (GRPO) and sequence (GSPO) clipped surrogates, each clipped in
    its own trust region.

        l_t = w_t ppo_clip_t(r_t; eps_low, eps_high)
              + (1 - w_t) gspo_t(s; seq_eps_low, seq_eps_high)

    "Orchestrating Tokens and Sequences: Dynamic Hybrid Policy Optimization for RLVR" (DHPO),
    Min et al. 2026, arXiv:2601.05607: averaged mixing
    (w = 1/2) or entropy-guided mixing (w_t = H_t / max over the sequence's loss tokens, needs
    `entropy_BT`). Branch-specific clipping keeps an outlier in one branch from dominating.
    w = 1 is ppo_clip, w = 0 is gspo. Shapes: all (B, T).
    """
    p = resolve(DHPOParams, cfg.params, "dhpo")
    tok = ppo_clip(inputs, cfg)
    seq = gspo(inputs, PPOClipConfig(p.seq_eps_low, p.seq_eps_high, cfg.dual_clip_c))
    if p.mixing == "mean":
        w_BT = torch.full_like(tok.token_loss_BT, 0.5)
    elif p.mixing == "entropy":
        if inputs.entropy_BT is None:
            raise ValueError("dhpo with mixing='entropy' needs entropy_BT")
        h_BT = torch.where(inputs.loss_mask_BT.bool(), inputs.entropy_BT.detach(), 0.0)
        w_BT = h_BT / h_BT.max(dim=1, keepdim=True).values.clamp_min(1e-12)
    else:
        raise ValueError(f"dhpo.mixing must be 'mean' or 'entropy', got {p.mixing!r}")
    loss_BT = w_BT * tok.token_loss_BT + (1 - w_BT) * seq.token_loss_BT
    stats = tok.token_stats | {
        "dhpo/token_weight": w_BT.detach(),
        "clip/frac_seq": seq.token_stats["clip/frac"],
    }
    return LossOutputs(loss_BT, stats)


@dataclass(frozen=True)
class ASPOParams:
    soft_cap: float = 3.0
    """Soft dual clip: the flipped weight of positive tokens is capped here (its value only;
    the gradient through log p still flows)."""


def aspo(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """ASPO: asymmetric importance sampling; the IS ratio of positive-advantage tokens is
    flipped, with a soft dual clip.

        A_t < 0:  l_t = ppo_clip_t                                   (unchanged)
        A_t > 0:  w_t = sg(min(1 / r_t, c));  l_t = -A_t w_t logp_t  if r_t <= 1 + eps_high
                  0 (no gradient) otherwise, as PPO's clip

    With the flip a positive token's gradient weight is pi_old / pi: tokens whose probability
    is still low relative to the rollout get more update and already-boosted ones less, the
    balance ASPO restores between positive and negative tokens. "ASPO: Asymmetric Importance
    Sampling Policy Optimization", Wang et al. 2025, arXiv:2510.06062. c = 3 is this library's
    default.
    """
    p = resolve(ASPOParams, cfg.params, "aspo")
    base = ppo_clip(inputs, cfg)
    mask_BT = inputs.loss_mask_BT.bool()
    log_ratio_BT = _token_log_ratio(inputs)
    ratio_BT = torch.exp(log_ratio_BT).detach()
    w_BT = (1.0 / ratio_BT).clamp(max=p.soft_cap)
    adv_BT = inputs.advantages_BT
    logp_BT = torch.where(mask_BT, inputs.logprobs_BT, torch.zeros_like(inputs.logprobs_BT))
    inside_BT = ratio_BT <= 1.0 + cfg.eps_high
    flipped_BT = torch.where(inside_BT, -adv_BT * w_BT * logp_BT, torch.zeros_like(logp_BT))
    loss_BT = torch.where(mask_BT & (adv_BT > 0), flipped_BT, base.token_loss_BT)
    return LossOutputs(loss_BT, base.token_stats | {"aspo/flipped_weight": w_BT})


@dataclass(frozen=True)
class CPPOParams:
    eps_early: float = 0.1
    """Clip range at the first response token (stricter)."""
    eps_late: float = 0.3
    """Clip range at the last response token (looser); linear in between."""
    prefix_budget: float = 1.0
    """Tokens whose cumulative prefix divergence sum_{s<t} |log r_s| exceeds this are masked."""


def cppo(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """CPPO: position-weighted clip thresholds and a cumulative prefix-divergence budget.

        u_t   = (j_t - 1) / max(n - 1, 1)     (j_t = 1-based position among n loss tokens)
        eps_t = eps_early + (eps_late - eps_early) u_t
        D_t   = sum_{s < t, loss} |log r_s|   (detached)
        l_t   = 1[D_t <= budget] max(-A r_t, -A clip(r_t, 1 - eps_t, 1 + eps_t))

    CPPO (Cumulative Prefix-divergence Policy Optimization), "Beyond Uniform Token-Level Trust
    Region in LLM Reinforcement Learning", Mao et al. 2026, arXiv:2606.10968: stricter limits early
    (their effect persists), and no further deviation once the prefix has drifted past the budget.
    eps 0.1 -> 0.3 and budget 1 nat are this library's defaults; eps_early = eps_late = 0.2 with an
    infinite budget is ppo_clip.
    """
    p = resolve(CPPOParams, cfg.params, "cppo")
    mask_BT = inputs.loss_mask_BT.bool()
    log_ratio_BT = _token_log_ratio(inputs)
    ratio_BT = torch.exp(log_ratio_BT)
    pos_BT = torch.cumsum(mask_BT.long(), dim=1)
    n_B = mask_BT.sum(dim=1, keepdim=True)
    u_BT = (pos_BT - 1).clamp_min(0).to(ratio_BT.dtype) / (n_B - 1).clamp_min(1)
    eps_BT = (p.eps_early + (p.eps_late - p.eps_early) * u_BT).detach()
    drift_BT = torch.cumsum(log_ratio_BT.detach().abs(), dim=1) - log_ratio_BT.detach().abs()
    keep_BT = mask_BT & (drift_BT <= p.prefix_budget)
    adv_BT = inputs.advantages_BT
    clipped_BT = torch.minimum(torch.maximum(ratio_BT, 1 - eps_BT), 1 + eps_BT)
    loss_BT = torch.maximum(-adv_BT * ratio_BT, -adv_BT * clipped_BT)
    loss_BT = torch.where(keep_BT, loss_BT, torch.zeros_like(loss_BT))
    with torch.no_grad():
        r = ratio_BT.detach()
        clip_BT = ((r < 1 - eps_BT) & (adv_BT < 0)) | ((r > 1 + eps_BT) & (adv_BT > 0))
    stats = {"clip/frac": clip_BT.float(), "cppo/masked_frac": (mask_BT & ~keep_BT).float()}
    return LossOutputs(loss_BT, stats | _ratio_stats(ratio_BT, log_ratio_BT))


def prefix_ratio(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """Prefix importance ratio: the token ratio times the detached ratio of its prefix.

        rho_t = sg(prod_{s < t} r_s) r_t = exp(sg(sum_{s<t} log r_s) + log r_t)
        l_t   = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))

    The state distribution of token t under the current policy differs from the rollout's by the
    prefix ratio; far off-policy (stale samples) the per-token ratio alone ignores that ("A Step
    Back: Prefix Importance Ratio Stabilizes Policy Optimization", Lei et al. 2026,
    arXiv:2601.22718, shows the prefix ratio is the rigorous correction; its MinPRO objective, the
    prefix's minimum token ratio instead of the product, is not what this part computes). The
    cumulative log ratio is clamped at the log-ratio limit. With r_s = 1 on the prefix it is
    ppo_clip.
    """
    mask_BT = inputs.loss_mask_BT.bool()
    log_ratio_BT = _token_log_ratio(inputs)
    prefix_BT = torch.cumsum(log_ratio_BT.detach(), dim=1) - log_ratio_BT.detach()
    log_rho_BT = (prefix_BT + log_ratio_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    out = _clipped_surrogate(torch.exp(log_rho_BT), log_rho_BT, inputs, cfg)
    stats = out.token_stats | {"prefix/log_ratio_mean": torch.where(mask_BT, prefix_BT, 0.0)}
    return LossOutputs(out.token_loss_BT, stats)


def wapo(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """WAPO: the clipped surrogate on positive-advantage completions only.

        l_t = ppo_clip_t  if A_t > 0  else 0

    "A Gradient Perspective on RLVR Stability and Winner Advantage Policy Optimization" (WAPO),
    YSS et al. 2026, arXiv:2606.16154 (code github.com/layer6ai-labs/wapo): negative-advantage
    updates are the unstable quadrant of its token-gradient taxonomy, so losers only serve as
    the baseline. Dropped tokens still count in the step normalizer.
    """
    base = ppo_clip(inputs, cfg)
    winners_BT = inputs.loss_mask_BT.bool() & (inputs.advantages_BT > 0)
    loss_BT = torch.where(winners_BT, base.token_loss_BT, torch.zeros_like(base.token_loss_BT))
    return LossOutputs(loss_BT, base.token_stats | {"wapo/kept_frac": winners_BT.float()})


def seq_elbo_ratio(inputs: LossInputs, cfg: PPOClipConfig) -> LossOutputs:
    """ESPO's sequence-level ratio with per-token normalization, as one sequence action.

        log s_b = (1 / L_b) (ELBO_theta(y_b) - ELBO_old(y_b))     (per-token normalization)
        l_b     = max(-A_b s_b, -A_b clip(s_b, 1 - eps_low, 1 + eps_high))
        l_bt    = l_b on every loss token of b (so any token-mean-per-sequence aggregation
                  gives l_b; use `seq_mean_token_mean`)

    ESPO (ELBO-based Sequence-level Policy Optimization), "Principled RL for Diffusion LLMs Emerges
    from a Sequence-Level Perspective", Ou et al. 2025, arXiv:2512.03759, for diffusion LLMs; for an
    autoregressive model the ELBO is the exact log-likelihood sum_t logp_t, so this is the sequence
    form (gradient through s_b itself) of GSPO. A_b is the sequence's mean token advantage. Use
    GSPO-like tiny clip ranges.
    """
    mask_BT = inputs.loss_mask_BT.bool()
    log_ratio_BT = _token_log_ratio(inputs)
    n_B = mask_BT.sum(dim=1).clamp_min(1).to(log_ratio_BT.dtype)
    log_s_B = (log_ratio_BT.sum(dim=1) / n_B).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    s_B = torch.exp(log_s_B)
    adv_B = torch.where(mask_BT, inputs.advantages_BT, 0.0).sum(dim=1) / n_B
    seq_loss_B = torch.maximum(-adv_B * s_B, -adv_B * s_B.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
    loss_BT = torch.where(
        mask_BT, seq_loss_B[:, None].expand_as(log_ratio_BT), torch.zeros_like(log_ratio_BT)
    )
    s_BT = s_B.detach()[:, None].expand_as(log_ratio_BT)
    clip_BT = ((s_BT < 1 - cfg.eps_low) | (s_BT > 1 + cfg.eps_high)).float()
    return LossOutputs(
        loss_BT,
        {"clip/frac": clip_BT}
        | _ratio_stats(s_BT, log_s_B.detach()[:, None].expand_as(log_ratio_BT)),
    )


def _masked(token_loss_BT: Tensor, loss_mask_BT: Tensor) -> Tensor:
    return torch.where(loss_mask_BT.bool(), token_loss_BT, torch.zeros_like(token_loss_BT))


def token_mean(token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer) -> Tensor:
    """sum_{b,t} m_bt l_bt / N_tokens: every loss token of the step weighs the same.

    DAPO's token-level loss: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    Yu et al. 2025, arXiv:2503.14476, section 3.3.
    """
    return _masked(token_loss_BT, loss_mask_BT).sum() / norm.tokens


def seq_mean_token_mean(
    token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer
) -> Tensor:
    """sum_b [sum_t m_bt l_bt / n_b] / N_sequences: each sequence's token mean, then the mean
    over sequences (the original GRPO objective, "DeepSeekMath", arXiv:2402.03300, eq. 3). A
    sequence without loss tokens contributes 0 and is not counted in N_sequences."""
    tokens_B = loss_mask_BT.sum(dim=1).clamp_min(1).to(token_loss_BT.dtype)
    per_seq_B = _masked(token_loss_BT, loss_mask_BT).sum(dim=1) / tokens_B
    return per_seq_B.sum() / norm.sequences


def constant_normalizer(
    token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer
) -> Tensor:
    """sum_{b,t} m_bt l_bt / (k N_sequences): each trajectory's token sum over a constant k.

    "AsyncWebRL: Efficient Multi-Step RL for Visual Web Agents", Bai et al. 2026, arXiv:2606.05597:
    the per-trajectory 1/|tau_i| of multi-step GRPO down-weights the negative gradient of (longer)
    failed trajectories; a constant 1/k removes that coupling. k = `norm.constant_k`
    (`[trainer.algorithm.params.constant_normalizer] k`, default 1024, a generation budget); k
    only rescales the gradient relative to `seq_mean_token_sum`.
    """
    return _masked(token_loss_BT, loss_mask_BT).sum() / (norm.sequences * norm.constant_k)


def seq_mean_token_sum(token_loss_BT: Tensor, loss_mask_BT: Tensor, norm: LossNormalizer) -> Tensor:
    """sum_{b,t} m_bt l_bt / N_sequences: token sums averaged over sequences, no length division.

    Dr. GRPO ("Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783,
    section 3.2) divides the token sum by a constant (the generation budget) instead of the sequence
    length; that constant only rescales the gradient, which AdamW's normalization absorbs, so it is
    left out here.
    """
    return _masked(token_loss_BT, loss_mask_BT).sum() / norm.sequences


LOSS_PARAMS: dict[str, type] = {
    "ppo_clip": NoParams,
    "gspo": NoParams,
    "cispo": NoParams,
    "dhpo": DHPOParams,
    "aspo": ASPOParams,
    "cppo": CPPOParams,
    "prefix_ratio": NoParams,
    "wapo": NoParams,
    "seq_elbo_ratio": NoParams,
}
"""Parameter dataclass of every policy loss (`NoParams`: takes none; the clip range and dual
clip are the `trainer.algorithm.clip_eps_low` / `clip_eps_high` / `dual_clip_c` settings)."""


@dataclass(frozen=True)
class ConstantNormalizerParams:
    k: float = 1024.0
    """The constant per-trajectory denominator (a generation budget in tokens)."""

    def __post_init__(self) -> None:
        if not self.k > 0:
            raise ValueError(f"k of 'constant_normalizer' must be > 0, got {self.k}")


AGGREGATION_PARAMS: dict[str, type] = {
    "token_mean": NoParams,
    "seq_mean_token_mean": NoParams,
    "seq_mean_token_sum": NoParams,
    "constant_normalizer": ConstantNormalizerParams,
}
"""Parameter dataclass of every aggregation; `constant_normalizer`'s k reaches it through the
step's `LossNormalizer.constant_k` (`normalizer_for`)."""

PolicyLossFn = Callable[[LossInputs, PPOClipConfig], LossOutputs]
AggregationFn = Callable[[Tensor, Tensor, LossNormalizer], Tensor]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "dhpo": dhpo,
    "aspo": aspo,
    "cppo": cppo,
    "prefix_ratio": prefix_ratio,
    "wapo": wapo,
    "seq_elbo_ratio": seq_elbo_ratio,
}
"""Policy losses by `TrainerSettings.policy_loss`."""

AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "constant_normalizer": constant_normalizer,
}
"""Aggregations by `TrainerSettings.loss_aggregation`."""
