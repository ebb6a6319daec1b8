"""Regularizers: per-token KL estimators against a reference policy, and the entropy bonus.

Each function maps (B, T) per-token tensors to a (B, T) per-token term (nats) that is added to
the token policy loss with a coefficient and then aggregated like it (`AGGREGATIONS`). They are
pure and keep the autograd graph of `logprobs_BT`; masking is the caller's (the aggregation
ignores masked positions). To add one: a function and one registry line plus a worked example in
`tests/unit/trainer/test_regularizers.py`.

KL estimators (Schulman 2020, "Approximating KL Divergence", joschu.net/blog/kl-approx.html; no
arXiv id), for KL(pi || ref) from tokens sampled from pi, with log r = ref_logp - logp:
    k1 = -log r = logp - ref_logp              unbiased, high variance, can be negative
    k2 = (log r)^2 / 2                         biased, low variance, >= 0
    k3 = (r - 1) - log r                       unbiased, low variance, >= 0 (GRPO's KL term,
                                               DeepSeekMath arXiv:2402.03300 eq. 4)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flywheel.trainer.algorithms.context import TokenContext, require
from flywheel.trainer.algorithms.losses import LOG_RATIO_LIMIT
from flywheel.trainer.algorithms.params import NoParams, resolve


def _log_r(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """(B, T) log(ref / pi), clamped so exp cannot overflow."""
    return (ref_logprobs_BT - logprobs_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k1 = logp - ref_logp per token, (B, T). E_pi[k1] = KL(pi || ref)."""
    return -_log_r(logprobs_BT, ref_logprobs_BT)


def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k2 = (logp - ref_logp)^2 / 2 per token, (B, T); >= 0, second-order accurate near ref."""
    return 0.5 * _log_r(logprobs_BT, ref_logprobs_BT) ** 2


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k3 = exp(ref_logp - logp) - 1 - (ref_logp - logp) per token, (B, T); >= 0 always
    (x - 1 >= log x), and E_pi[k3] = KL(pi || ref) because E_pi[r] = 1."""
    log_r_BT = _log_r(logprobs_BT, ref_logprobs_BT)
    return torch.expm1(log_r_BT) - log_r_BT


def _surrogate(value_BT: Tensor, score_BT: Tensor, logprobs_BT: Tensor) -> Tensor:
    """A (B, T) term whose value is sg(value) and whose gradient is sg(score) grad logp: the
    score-function (REINFORCE) form of a sampled-token estimator."""
    return value_BT.detach() + score_BT.detach() * (logprobs_BT - logprobs_BT.detach())


def entropy_bonus(entropy_BT: Tensor, coef: float) -> Tensor:
    """Entropy bonus as a loss term: l_t = -coef * H_t, (B, T), H_t in nats.

    Minimizing it raises the policy entropy (Williams & Peng 1991, "Function Optimization using
    Connectionist Reinforcement Learning Algorithms", Connection Science, no arXiv id; used as in
    PPO, "Proximal Policy Optimization Algorithms", arXiv:1707.06347 eq. 9, c2 ~ 0.01). Only as
    differentiable as `entropy_BT`: the step's fused head returns a detached entropy, so use
    `entropy_bonus_sampled` for a gradient.
    """
    return -coef * entropy_BT


def entropy_bonus_sampled(ctx: TokenContext, p: NoParams) -> Tensor:
    """Entropy bonus as a loss term: l_t ~ -H_t (B, T), nats; minimizing it raises entropy.

    Sampled-token estimator (the step's fused head keeps no full distribution with a gradient):
    with y_t ~ pi, E[-log pi(y_t)] = H_t and grad H = -E[log pi(y) grad log pi(y)], so

        l_t = sg(log pi(y_t)) + sg(log pi(y_t)) (log pi(y_t) - sg(log pi(y_t)))

    has E[l_t] = -H_t and E[grad l_t] = -grad H_t. PPO, "Proximal Policy Optimization Algorithms",
    Schulman et al. 2017, arXiv:1707.06347, eq. 9 (coefficient c2 ~ 0.01, set in
    `trainer.algorithm.regularizers`).
    """
    logp_BT = require(ctx, "logprobs_BT", "entropy_bonus_sampled")
    return _surrogate(logp_BT, logp_BT, logp_BT)


def entropy_min(ctx: TokenContext, p: NoParams) -> Tensor:
    """Entropy minimization: l_t ~ +H_t (B, T), the negative of `entropy_bonus_sampled`.

    EM-RL / EM-FT of "The Unreasonable Effectiveness of Entropy Minimization in LLM Reasoning",
    Agarwal et al. 2025, arXiv:2505.15134: negative entropy as the only reward (use it with
    coefficient 1 and advantage "none"-like zero rewards) or as a term beside the RL loss.
    """
    return -entropy_bonus_sampled(ctx, p)


def _teacher_log_ratio(ctx: TokenContext, part: str) -> tuple[Tensor, Tensor]:
    logp_BT = require(ctx, "logprobs_BT", part)
    teacher_BT = require(ctx, "teacher_logprobs_BT", part)
    return logp_BT, (logp_BT - teacher_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def distill_rkl(ctx: TokenContext, p: NoParams) -> Tensor:
    """Reverse KL(pi || teacher) per token from student samples (on-policy distillation).

        value  d_t = log pi(y_t) - log q(y_t)        (E_pi[d] = KL(pi || q))
        grad   sg(d_t) grad log pi(y_t)             (E = grad KL, since E_pi[grad log pi] = 0)

    "On-Policy Distillation of Language Models", Agarwal et al. 2024, arXiv:2306.13649; the
    RL-style reverse-KL objective of the KL-direction study ("Decoupling KL and Trajectories: A
    Unified Perspective for SFT, DAgger, Offline RL, and OPD in LLM Distillation",
    arXiv:2605.16826).
    Zero where the teacher has no logprob (teacher_logprobs_BT 0 and mask off: mask it out).
    """
    logp_BT, d_BT = _teacher_log_ratio(ctx, "distill_rkl")
    return _surrogate(d_BT, d_BT, logp_BT)


def distill_fkl(ctx: TokenContext, p: NoParams) -> Tensor:
    """Forward KL(teacher || pi) per token from student samples, importance weighted.

        w_t = q(y_t) / pi(y_t);   value w_t (log q - log pi);   grad -sg(w_t) grad log pi(y_t)

    E_pi[w (log q - log pi)] = KL(q || pi) and E_pi[-w grad log pi] = grad KL(q || pi). The SFT-
    style forward-KL direction of the KL-direction study ("Decoupling KL and Trajectories",
    arXiv:2605.16826);
    w is clamped through the log-ratio limit.
    """
    logp_BT, d_BT = _teacher_log_ratio(ctx, "distill_fkl")
    w_BT = torch.exp(-d_BT)
    return _surrogate(-w_BT * d_BT, -w_BT, logp_BT)


@dataclass(frozen=True)
class MixedKLParams:
    forward_weight: float = 0.5
    """lambda: l = lambda FKL + (1 - lambda) RKL (KL mixing)."""


def distill_mixed(ctx: TokenContext, p: MixedKLParams) -> Tensor:
    """KL mixing: lambda * forward KL + (1 - lambda) * reverse KL to the teacher, per token.

    KL mixing of the distillation design-space study ("Decoupling KL and Trajectories: A Unified
    Perspective for SFT, DAgger, Offline RL, and OPD in LLM Distillation", arXiv:2605.16826, which
    finds long sequences need substantial forward-KL weight); lambda = 0.5 is this library's
    default. lambda = 0 is `distill_rkl`, lambda = 1 is `distill_fkl`.
    """
    return p.forward_weight * distill_fkl(ctx, NoParams()) + (1 - p.forward_weight) * distill_rkl(
        ctx, NoParams()
    )


@dataclass(frozen=True)
class TopKDistillParams:
    direction: str = "reverse"
    """`reverse` KL(pi || q), `forward` KL(q || pi), or `mixed` (forward_weight of forward)."""
    forward_weight: float = 0.5
    """lambda of `mixed`."""
    eps: float = 1e-6
    """Floor on the tail masses before the log."""


def _binned(logp_BTK: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(B, T, K+1) probabilities and logprobs: the K given tokens plus one tail bin."""
    probs_BTK = logp_BTK.exp()
    tail_BT1 = (1 - probs_BTK.sum(dim=-1, keepdim=True)).clamp_min(eps)
    return torch.cat([probs_BTK, tail_BT1], -1), torch.cat([logp_BTK, tail_BT1.log()], -1)


def distill_topk(ctx: TokenContext, p: TopKDistillParams) -> Tensor:
    """Distillation KL over the teacher's top-K tokens plus a tail bin, per position.

        bins      = the teacher's K most likely tokens + "everything else"
        q_tail    = 1 - sum_k q_k,   pi_tail = 1 - sum_k pi_k        (floored at eps)
        reverse:  sum_{bins} pi (log pi - log q);   forward: sum_{bins} q (log q - log pi)

    Exact over the K+1 bins (no sampling): with K = V it is the full KL. The teacher's top-K
    (Sample.teacher_topk_ids / teacher_topk_logprobs) is what the teacher service stores; the tail
    bin keeps the K-term sum a proper divergence between two distributions (OpenClaw-RL's hindsight
    OPD with top-k, "OpenClaw-RL: Train Any Agent Simply by Talking", arXiv:2603.10165; KL
    directions as in "Decoupling KL and Trajectories", arXiv:2605.16826). Needs the student's
    logprobs at the teacher's ids with grad: (B, T, K) each, which the step gathers from the same
    full-vocabulary logits as the student's own top-k (`pipeline.student_topk`); absent slots hold
    TOPK_ABSENT on both sides, so they add 0.
    """
    teacher_BTK = require(ctx, "teacher_topk_logprobs_BTK", "distill_topk").detach()
    student_BTK = require(ctx, "student_at_teacher_topk_BTK", "distill_topk")
    q, log_q = _binned(teacher_BTK, p.eps)
    pi, log_pi = _binned(student_BTK, p.eps)
    reverse_BT = (pi * (log_pi - log_q)).sum(dim=-1)
    forward_BT = (q * (log_q - log_pi)).sum(dim=-1)
    if p.direction == "reverse":
        return reverse_BT
    if p.direction == "forward":
        return forward_BT
    if p.direction == "mixed":
        return p.forward_weight * forward_BT + (1 - p.forward_weight) * reverse_BT
    raise ValueError(
        f"distill_topk.direction must be reverse, forward or mixed, got {p.direction!r}"
    )


@dataclass(frozen=True)
class GRSPParams:
    scale: float = 1.0
    """Penalty of one group-std of extra length, in advantage units."""


def grsp(ctx: TokenContext, p: GRSPParams) -> Tensor:
    """Group-relative length penalty as a policy-gradient term (GRSP-style).

        z_i = (n_i - mean_G(n)) / std_G(n)        n_i = loss tokens of sample i
        l_t = -A^pen_i log pi(y_t)  with  A^pen_i = -scale * z_i       (value sg(A^pen) ...)

    so longer-than-group responses are pushed down and shorter ones up, relative to their group.
    GRSP (Group Relative Segment Penalization), "Mitigating Overthinking through Reasoning Shaping",
    Song et al. 2025, arXiv:2510.09535, weights penalties by reasoning segments; without segment
    boundaries in the Sample, each response is one segment here. Groups with equal lengths (std 0)
    or one member give exactly 0.
    """
    logp_BT = require(ctx, "logprobs_BT", "grsp")
    n_B = ctx.loss_mask_BT.sum(dim=1).double()
    z_B = torch.zeros_like(n_B)
    for g in torch.unique(ctx.group_index_B).tolist():
        idx = (ctx.group_index_B == g).nonzero(as_tuple=True)[0]
        if idx.numel() > 1:
            std = float(n_B[idx].std())
            if std > 0:
                z_B[idx] = (n_B[idx] - n_B[idx].mean()) / std
    adv_BT = (-p.scale * z_B).to(logp_BT.dtype)[:, None].expand_as(logp_BT)
    return -adv_BT * logp_BT


@dataclass(frozen=True)
class SimKOParams:
    top_k: int = 3
    """K candidates boosted on correct responses."""
    alpha: float = 0.1
    """Share of a positive token's update moved to the mean of its top-K candidates."""
    top1_penalty: float = 1.1
    """lambda: a wrong response's top-1 token is pushed down lambda times as hard."""
    min_entropy: float = 1.0
    """Applied at tokens whose entropy (nats) is at least this (SimKO acts at forking tokens).
    A fixed threshold, not a batch quantile, so gradient accumulation stays exact."""


def simko(ctx: TokenContext, p: SimKOParams) -> Tensor:
    """SimKO (simple pass@K optimization), as a term beside the policy loss.

        high-entropy token, A_t > 0:  l_t = -A_t alpha (mean_{k <= K} log pi_k - log pi(y_t))
        high-entropy token, A_t < 0 and y_t is the top-1 candidate:
                                      l_t = -A_t (lambda - 1) log pi(y_t)

    Added to the policy loss (whose on-policy gradient is -A grad log pi(y_t)) it moves a share
    alpha of a correct token's push onto its top-K alternatives, and penalizes an incorrect
    response's top-1 choice lambda times as hard: the asymmetry SimKO uses against probability
    over-concentration ("SimKO: Simple Pass@K Policy Optimization", Peng et al. 2025,
    arXiv:2510.14807).
    Needs `topk_logprobs_BTK` with grad (a full-vocabulary head pass) and entropy; the paper's
    K, alpha, lambda are not in the abstract: 3, 0.1, 1.1, H >= 1 nat are this library's.
    """
    logp_BT = require(ctx, "logprobs_BT", "simko")
    topk_BTK = require(ctx, "topk_logprobs_BTK", "simko")[..., : p.top_k]
    entropy_BT = require(ctx, "entropy_BT", "simko")
    mask_BT = ctx.loss_mask_BT.bool()
    fork_BT = mask_BT & (entropy_BT >= p.min_entropy)
    adv_BT = ctx.advantages_BT
    boost_BT = -adv_BT * p.alpha * (topk_BTK.mean(dim=-1) - logp_BT)
    top1_BT = (logp_BT.detach() - topk_BTK[..., 0].detach()).abs() < 1e-6
    penalty_BT = -adv_BT * (p.top1_penalty - 1) * logp_BT
    term_BT = torch.where(fork_BT & (adv_BT > 0), boost_BT, torch.zeros_like(logp_BT))
    return torch.where(fork_BT & (adv_BT < 0) & top1_BT, penalty_BT, term_BT)


@dataclass(frozen=True)
class LpRegParams:
    noise_ratio: float = 0.02
    """kappa: candidates with pi < kappa max pi are noise, removed from the proxy."""
    low_prob: float = 0.1
    """Sampled tokens below this probability are the protected "sparks"."""


def lp_reg(ctx: TokenContext, p: LpRegParams) -> Tensor:
    """Lp-Reg: KL toward a filtered, renormalized proxy that protects low-probability sparks.

        proxy_k = pi_k 1[pi_k >= kappa max pi] / Z          over the top-K candidates (detached)
        l_t     = 1[A_t < 0, pi(y_t) < delta, pi(y_t) >= kappa max pi]
                  sum_k proxy_k (log proxy_k - log pi_k)      = KL(proxy || pi)

    On negative samples a low-probability but non-noise token (a "reasoning spark") is pulled
    back toward the proxy, where its probability is amplified by the renormalization, instead
    of being extinguished ("Low-probability Tokens Sustain Exploration in Reinforcement Learning
    with Verifiable Reward", Lp-Reg, Huang et al. 2025, arXiv:2510.03222). Needs
    `topk_logprobs_BTK` with grad. kappa = 0.02 and delta = 0.1 are this library's defaults
    (the abstract gives none).
    """
    logp_BT = require(ctx, "logprobs_BT", "lp_reg")
    topk_BTK = require(ctx, "topk_logprobs_BTK", "lp_reg")
    probs_BTK = topk_BTK.detach().exp()
    keep_BTK = probs_BTK >= p.noise_ratio * probs_BTK[..., :1]
    proxy_BTK = torch.where(keep_BTK, probs_BTK, 0.0)
    proxy_BTK = proxy_BTK / proxy_BTK.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    log_proxy_BTK = torch.where(keep_BTK, proxy_BTK.clamp_min(1e-30).log(), 0.0)
    kl_BT = (proxy_BTK * (log_proxy_BTK - torch.where(keep_BTK, topk_BTK, 0.0))).sum(dim=-1)
    p_t = logp_BT.detach().exp()
    spark_BT = (
        ctx.loss_mask_BT.bool()
        & (ctx.advantages_BT < 0)
        & (p_t < p.low_prob)
        & (p_t >= p.noise_ratio * probs_BTK[..., 0])
    )
    return torch.where(spark_BT, kl_BT, torch.zeros_like(kl_BT))


KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimatorFn] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Per-token KL(pi || ref) estimators by name; as regularizer terms the reference is the rollout
policy (`old_logprobs_BT`), since the stack keeps no separate reference model."""

TermFn = Callable[[TokenContext, Any], Tensor]

REGULARIZERS: dict[str, Callable[[Tensor, float], Tensor]] = {"entropy_bonus": entropy_bonus}
"""Per-token regularizers on a given entropy: `(entropy_BT, coef) -> (B, T)`."""

TERMS: dict[str, TermFn] = {
    "entropy_bonus_sampled": entropy_bonus_sampled,
    "entropy_min": entropy_min,
    "distill_rkl": distill_rkl,
    "distill_fkl": distill_fkl,
    "distill_mixed": distill_mixed,
    "grsp": grsp,
    "simko": simko,
    "lp_reg": lp_reg,
    "distill_topk": distill_topk,
}
"""Regularizer terms selected by `TrainerSettings.regularizers` (with the KL estimators):
`(TokenContext, params) -> (B, T)`, added to the token loss times their coefficient."""

TERM_PARAMS: dict[str, type[Any]] = {
    "k1": NoParams,
    "k2": NoParams,
    "k3": NoParams,
    "entropy_bonus_sampled": NoParams,
    "entropy_min": NoParams,
    "distill_rkl": NoParams,
    "distill_fkl": NoParams,
    "distill_mixed": MixedKLParams,
    "grsp": GRSPParams,
    "simko": SimKOParams,
    "lp_reg": LpRegParams,
    "distill_topk": TopKDistillParams,
}


def apply_term(name: str, ctx: TokenContext, overrides: Mapping[str, Any] | None = None) -> Tensor:
    """The (B, T) term of regularizer `name` (KL estimators against the rollout logprobs)."""
    params = resolve(TERM_PARAMS[name], overrides, name)
    if name in KL_ESTIMATORS:
        logp_BT = require(ctx, "logprobs_BT", name)
        return KL_ESTIMATORS[name](logp_BT, ctx.old_logprobs_BT)
    return TERMS[name](ctx, params)
