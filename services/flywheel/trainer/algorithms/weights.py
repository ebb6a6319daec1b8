"""Token weights, masks and selection: advantages (B, T) -> re-weighted advantages (B, T).

Every part has the signature `(TokenContext, params) -> WeightOutputs` and is registered in
`WEIGHTS` under the name listed in `TrainerSettings.token_weights` (applied in that order). A
weight w_t >= 0 multiplies the token's advantage; for the clipped surrogates this is the same as
multiplying the token's loss, because max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)) for
w >= 0 (and likewise for the dual clip). A dropped token (w = 0) still counts in the step's
normalizer (fixed before the micro-batch loop), so a mask scales the gradient instead of
renormalizing it, exactly like the train-inference corrections.

They run once per step on the whole batch (`pipeline.batch_stage`), so batch quantiles are
the same whatever the micro-batch size. Parts that read `entropy_BT` make the step score the
batch once without gradient first (the old policy equals the current one before the single
optimizer step, so this is the entropy the loss sees).

Shapes: B = samples, T = tokens, all (B, T) tensors aligned with `token_ids`; padding and
prompt tokens (mask False) always get weight 0 and keep advantage 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flywheel.trainer.algorithms.context import TokenContext, masked, masked_quantile, require
from flywheel.trainer.algorithms.params import NoParams, resolve


@dataclass(frozen=True)
class WeightOutputs:
    advantages_BT: Tensor
    """(B, T) float32 re-weighted advantages; exactly 0 off the loss mask."""
    metrics: dict[str, float]
    """Scalars for the step's metrics line (`weight/...`)."""


def _apply(ctx: TokenContext, weights_BT: Tensor, name: str, **extra: float) -> WeightOutputs:
    mask_BT = ctx.loss_mask_BT.bool()
    w_BT = masked(weights_BT.float(), mask_BT)
    kept = w_BT[mask_BT]
    metrics = {
        f"weight/{name}/kept_frac": float((kept > 0).float().mean()) if kept.numel() else 0.0,
        f"weight/{name}/mean": float(kept.mean()) if kept.numel() else 0.0,
    } | {f"weight/{name}/{k}": v for k, v in extra.items()}
    return WeightOutputs(masked(ctx.advantages_BT.float() * w_BT, mask_BT), metrics)


# --- high_entropy_only -------------------------------------------------------------------


@dataclass(frozen=True)
class HighEntropyParams:
    top_frac: float = 0.2
    """q: fraction of the batch's loss tokens kept, by entropy (paper: 0.2)."""


def high_entropy_only(ctx: TokenContext, p: HighEntropyParams) -> WeightOutputs:
    """Train only on the top-q fraction of tokens by predictive entropy ("forking" tokens).

        tau  = Quantile_{1 - q}({H_t : m_t = 1})          over the whole step batch
        w_t  = 1[H_t >= tau]                              A'_t = w_t A_t

    "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning
    for LLM Reasoning", Wang et al. 2025, arXiv:2506.01939 (q = 0.2: the policy gradient only on
    the 20% highest-entropy tokens). Shapes: entropy_BT, advantages_BT (B, T). Ties at tau are
    all kept, so slightly more than q may be kept.
    """
    if not 0.0 < p.top_frac <= 1.0:
        raise ValueError(f"high_entropy_only.top_frac must be in (0, 1], got {p.top_frac}")
    entropy_BT = require(ctx, "entropy_BT", "high_entropy_only")
    tau = masked_quantile(entropy_BT, ctx.loss_mask_BT, 1.0 - p.top_frac)
    return _apply(ctx, (entropy_BT >= tau).float(), "high_entropy_only", threshold=tau)


# --- entropy_gate (EGSPO) ----------------------------------------------------------------


@dataclass(frozen=True)
class EntropyGateParams:
    high_frac: float = 0.2
    """Fraction of loss tokens (highest entropy) that get the full update."""
    low_weight: float = 0.1
    """Weight of the remaining low-entropy tokens (attenuated, never 0: they keep the sign of A)."""


def entropy_gate(ctx: TokenContext, p: EntropyGateParams) -> WeightOutputs:
    """EGSPO entropy-gated update: full PPO update on high-entropy tokens, attenuated elsewhere.

        tau = Quantile_{1 - f}({H_t : m_t = 1});   w_t = 1 if H_t >= tau else beta

    "Entropy-Gated Selective Policy Optimization: Token-Level Gradient Allocation for Hybrid
    Training of Large Language Models" (EGSPO), Hu et al. 2026, arXiv:2602.03309. Both branches keep
    A_t, so incorrect trajectories are still pushed down everywhere. The abstract gives no numbers:
    f = 0.2 and beta = 0.1 are this library's defaults. With beta = 1 this is plain GRPO.
    """
    entropy_BT = require(ctx, "entropy_BT", "entropy_gate")
    tau = masked_quantile(entropy_BT, ctx.loss_mask_BT, 1.0 - p.high_frac)
    w_BT = torch.where(entropy_BT >= tau, 1.0, p.low_weight)
    return _apply(ctx, w_BT, "entropy_gate", threshold=tau)


# --- entropy_weighted (GTPO) -------------------------------------------------------------


@dataclass(frozen=True)
class EntropyWeightedParams:
    alpha1: float = 1.0
    """Weight of the sequence reward term."""
    alpha2: float = 1.0
    """Weight of the entropy term."""
    eps: float = 1e-6
    """Floor on entropies before 1/H (a certain token)."""


def entropy_weighted(ctx: TokenContext, p: EntropyWeightedParams) -> WeightOutputs:
    """GTPO dynamic entropy weighting of token rewards.

        positive A:  w_t = alpha1 + alpha2 H_t / mean_{+}(H)
        negative A:  w_t = alpha1 + alpha2 (1 / H_t) / mean_{-}(1 / H)      A'_t = w_t A_t

    mean_{+} / mean_{-} run over the loss tokens of positive / negative advantage in the batch,
    so each polarity's mean weight is alpha1 + alpha2: high-entropy tokens of successful
    responses get more credit, confident tokens of failed responses more blame. "GTPO and
    GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy", Tan et al. 2025,
    arXiv:2508.04349 (alpha1 = alpha2 = 1). With alpha2 = 0, alpha1 = 1 this is GRPO.
    """
    entropy_BT = require(ctx, "entropy_BT", "entropy_weighted")
    mask_BT = ctx.loss_mask_BT.bool()
    h_BT = entropy_BT.double().clamp_min(p.eps)
    pos_BT, neg_BT = mask_BT & (ctx.advantages_BT > 0), mask_BT & (ctx.advantages_BT < 0)
    h_pos = h_BT[pos_BT].mean() if pos_BT.any() else torch.tensor(1.0, dtype=torch.float64)
    inv_neg = (1 / h_BT[neg_BT]).mean() if neg_BT.any() else torch.tensor(1.0, dtype=torch.float64)
    w_BT = torch.where(
        pos_BT,
        p.alpha1 + p.alpha2 * h_BT / h_pos,
        torch.where(neg_BT, p.alpha1 + p.alpha2 / h_BT / inv_neg, torch.ones_like(h_BT)),
    )
    return _apply(ctx, w_BT, "entropy_weighted")


# --- surprisal_reweight (STARE) ----------------------------------------------------------


@dataclass(frozen=True)
class SurprisalParams:
    quantile: float = 0.2
    """Tokens in the top / bottom `quantile` of batch surprisal are entropy-critical."""
    strength: float = 0.5
    """lambda: critical tokens get weight 1 +- lambda."""
    target_entropy: float = 0.5
    """Target mean token entropy (nats) of the closed-loop gate."""


def surprisal_reweight(ctx: TokenContext, p: SurprisalParams) -> WeightOutputs:
    """STARE: surprisal-guided token advantage reweighting with a target-entropy gate.

    Under a policy-gradient step a token's entropy change has the sign of A_t times its
    surprisal side: raising a rare token (A > 0, high surprisal s_t = -log p_old) or lowering a
    likely one (A < 0, low surprisal) raises entropy (set E+); the other two quadrants lower it
    (E-). With high/low = the batch's top/bottom `quantile` of surprisal over loss tokens and
    g = +1 if mean_t H_t < H_target (entropy too low) else -1:

        w_t = 1 + lambda g  on E+,   1 - lambda g  on E-,   1 elsewhere

    "STARE: Surprisal-Guided Token-Level Advantage Reweighting for Policy Entropy Stability", Luo et
    al. 2026, arXiv:2606.19236 (code github.com/hp-luo/STARE). The abstract gives no numbers:
    quantile 0.2, lambda 0.5, H_target 0.5 nats are this library's defaults. lambda = 0 is GRPO.
    """
    entropy_BT = require(ctx, "entropy_BT", "surprisal_reweight")
    mask_BT = ctx.loss_mask_BT.bool()
    s_BT = -ctx.old_logprobs_BT.float()
    hi = masked_quantile(s_BT, mask_BT, 1.0 - p.quantile)
    lo = masked_quantile(s_BT, mask_BT, p.quantile)
    high_BT, low_BT = s_BT >= hi, s_BT <= lo
    adv_BT = ctx.advantages_BT
    up_BT = ((adv_BT > 0) & high_BT) | ((adv_BT < 0) & low_BT)
    down_BT = ((adv_BT > 0) & low_BT) | ((adv_BT < 0) & high_BT)
    sel = entropy_BT[mask_BT]
    mean_h = float(sel.mean()) if sel.numel() else 0.0
    g = 1.0 if mean_h < p.target_entropy else -1.0
    w_BT = torch.where(
        up_BT & ~down_BT, 1 + p.strength * g, torch.where(down_BT & ~up_BT, 1 - p.strength * g, 1.0)
    )
    return _apply(ctx, w_BT, "surprisal_reweight", gate=g, entropy=mean_h)


# --- entropy_change (STEER) --------------------------------------------------------------


@dataclass(frozen=True)
class EntropyChangeParams:
    beta: float = 0.5
    """How strongly predicted entropy decrease is damped."""
    min_weight: float = 0.2
    max_weight: float = 2.0


def entropy_change(ctx: TokenContext, p: EntropyChangeParams) -> WeightOutputs:
    """STEER-style reweighting by the first-order predicted token entropy change.

    For a softmax policy a step along A_t grad log p(y_t) changes the entropy by about
    -eta A_t (log p(y_t) + H_t) (the centred log-probability; Cui et al. 2025, "The Entropy
    Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv:2505.22617). With
    c_t = A_t (log p_old(y_t) + H_t) and z_t = c_t / mean_mask |c|:

        w_t = clip(1 - beta z_t, w_min, w_max)

    tokens predicted to collapse entropy (c > 0) are damped, entropy-raising ones amplified. STEER
    ("Rethinking Entropy Interventions in RLVR: An Entropy Change Perspective", Hao et al. 2025,
    arXiv:2510.10150) reweights by the predicted change; beta = 0.5 and [0.2, 2] are this library's
    defaults. beta = 0 is GRPO.
    """
    entropy_BT = require(ctx, "entropy_BT", "entropy_change")
    mask_BT = ctx.loss_mask_BT.bool()
    c_BT = masked(ctx.advantages_BT.double() * (ctx.old_logprobs_BT.double() + entropy_BT), mask_BT)
    scale = float(c_BT[mask_BT].abs().mean()) if mask_BT.any() else 0.0
    z_BT = c_BT / scale if scale > 0 else torch.zeros_like(c_BT)
    w_BT = (1 - p.beta * z_BT).clamp(p.min_weight, p.max_weight)
    return _apply(ctx, w_BT, "entropy_change")


# --- uncertainty_shaping (UCAS) ----------------------------------------------------------


@dataclass(frozen=True)
class UncertaintyParams:
    alpha: float = 0.5
    """Response-level confidence modulation strength."""
    beta: float = 0.1
    """Token-level certainty penalty."""


def uncertainty_shaping(ctx: TokenContext, p: UncertaintyParams) -> WeightOutputs:
    """UCAS: response self-confidence modulation, then a token certainty penalty.

        c_i   = exp(mean_t log p_old(y_it))                (geometric-mean token probability)
        A'_i  = A_i (1 + alpha (1 - c_i))  if A_i > 0      (uncertain but correct: more credit)
                A_i (1 + alpha c_i)        if A_i < 0      (confident but wrong: more blame)
        A'_t  = A'_i - beta p_old(y_t) 1[A_i != 0]         (penalty on certain tokens)

    UCAS (UnCertainty-aware Advantage Shaping), "Unlocking Exploration in RLVR: Uncertainty-aware
    Advantage Shaping for Deeper Reasoning", Xie et al. 2025, arXiv:2510.10649. The abstract gives
    no numbers: alpha = 0.5, beta = 0.1 are this library's defaults; the token certainty is the
    sampled token's rollout probability. alpha = beta = 0 is GRPO. Reads only rollout logprobs: no
    extra model outputs.
    """
    mask_BT = ctx.loss_mask_BT.bool()
    n_B = mask_BT.sum(dim=1).clamp_min(1)
    conf_B = torch.exp(masked(ctx.old_logprobs_BT.double(), mask_BT).sum(dim=1) / n_B)
    adv_BT = ctx.advantages_BT.double()
    scale_BT = torch.where(
        adv_BT > 0, 1 + p.alpha * (1 - conf_B[:, None]), 1 + p.alpha * conf_B[:, None]
    )
    penalty_BT = p.beta * ctx.old_logprobs_BT.double().exp() * (adv_BT != 0)
    shaped_BT = masked(adv_BT * scale_BT - penalty_BT, mask_BT).float()
    metrics = {"weight/uncertainty_shaping/confidence": float(conf_B.mean())}
    return WeightOutputs(shaped_BT, metrics)


# --- d3s ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class D3SParams:
    sample_frac: float = 0.5
    """Fraction of each group's samples kept at step 0."""
    token_frac: float = 0.5
    """Fraction of the kept samples' tokens kept at step 0 (by |A| H)."""
    relax_steps: int = 100
    """Both fractions rise linearly to 1 over this many optimizer steps."""


def _max_var_subset(values_n: Tensor, k: int) -> Tensor:
    """Indices of k of the values with the largest variance: j largest plus k - j smallest."""
    order = torch.argsort(values_n)
    n, best, best_var = values_n.numel(), order[:k], -1.0
    for j in range(k + 1):
        idx = torch.cat([order[: k - j], order[n - j :]]) if j else order[:k]
        var = float(values_n[idx].double().var(unbiased=False)) if k > 1 else 0.0
        if var > best_var + 1e-12:
            best, best_var = idx, var
    return best


def d3s(ctx: TokenContext, p: D3SParams) -> WeightOutputs:
    """D^3S: dynamic dual-level down-sampling of samples (max Var(A)) and tokens (|A| H).

        rho(step)  = rho_0 + (1 - rho_0) min(step / S, 1)
        samples:   per group, the ceil(rho_s n) samples whose advantages have the largest
                   variance (an extreme set: the j largest and k - j smallest, best j)
        tokens:    of the kept samples' loss tokens, those with |A_t| H_t >= the
                   (1 - rho_t)-quantile are kept;  w_t in {0, 1}

    D^3S (Dynamic Dual-Level Down-Sampling), "Learning More with Less: A Dynamic Dual-Level
    Down-Sampling Framework for Efficient Policy Optimization", Wang et al. 2025, arXiv:2509.22115.
    The schedule starts aggressive and relaxes; the abstract gives no numbers: rho_0 = 0.5 for both
    levels and S = 100 steps are this library's defaults. At rho = 1 this is GRPO.
    """
    entropy_BT = require(ctx, "entropy_BT", "d3s")
    ramp = min(ctx.step / p.relax_steps, 1.0) if p.relax_steps > 0 else 1.0
    rho_s = p.sample_frac + (1 - p.sample_frac) * ramp
    rho_t = p.token_frac + (1 - p.token_frac) * ramp
    mask_BT = ctx.loss_mask_BT.bool()
    n_tok_B = mask_BT.sum(dim=1).clamp_min(1)
    adv_B = masked(ctx.advantages_BT.double(), mask_BT).sum(dim=1) / n_tok_B
    keep_B = torch.zeros(adv_B.shape[0], dtype=torch.bool)
    for g in torch.unique(ctx.group_index_B).tolist():
        idx = (ctx.group_index_B == g).nonzero(as_tuple=True)[0]
        k = max(math.ceil(rho_s * idx.numel() - 1e-9), 1)
        keep_B[idx[_max_var_subset(adv_B[idx], k)]] = True
    token_mask_BT = mask_BT & keep_B[:, None]
    score_BT = ctx.advantages_BT.abs().double() * entropy_BT.double()
    tau = masked_quantile(score_BT, token_mask_BT, 1.0 - rho_t) if rho_t < 1 else -math.inf
    w_BT = (token_mask_BT & (score_BT >= tau)).float()
    return _apply(ctx, w_BT, "d3s", sample_frac=rho_s, token_frac=rho_t)


# --- nat (URS / RPC) ---------------------------------------------------------------------


@dataclass(frozen=True)
class NatParams:
    scheme: str = "urs"
    """`urs` (uniform random token sampling) or `rpc` (random prefix cutting)."""
    keep_prob: float = 0.5
    """URS inclusion probability pi of every token."""
    seed: int = 0
    """Selection is drawn from a generator seeded with (seed, step): reproducible."""


def nat(ctx: TokenContext, p: NatParams) -> WeightOutputs:
    """Not All Tokens Are Needed: token subsampling with Horvitz-Thompson reweighting.

        URS:  keep_t ~ Bernoulli(pi),  w_t = keep_t / pi
        RPC:  per sequence of n loss tokens, L ~ Uniform{1..n}; keep the loss tokens at
              positions j <= L (1-based among loss tokens); pi_j = P(L >= j) = (n - j + 1) / n,
              w_j = keep_j / pi_j

    E[w_t] = 1 for every loss token, so the token-sum gradient estimate is unbiased (NAT, "Not All
    Tokens Are Needed (NAT): Token Efficient Reinforcement Learning", Sang et al. 2026,
    arXiv:2603.06619; URS and RPC as named there; pi = 0.5 matches its "as few as 50% of tokens").
    Dropped tokens still need their forward pass here (the saving the paper reports needs a sparse
    forward).
    """
    mask_BT = ctx.loss_mask_BT.bool()
    gen = torch.Generator().manual_seed(p.seed * 1_000_003 + ctx.step)
    if p.scheme == "urs":
        if not 0.0 < p.keep_prob <= 1.0:
            raise ValueError(f"nat.keep_prob must be in (0, 1], got {p.keep_prob}")
        keep_BT = torch.rand(mask_BT.shape, generator=gen) < p.keep_prob
        w_BT = keep_BT.double() / p.keep_prob
    elif p.scheme == "rpc":
        pos_BT = torch.cumsum(mask_BT.long(), dim=1)  # 1-based position among loss tokens
        n_B = mask_BT.sum(dim=1)
        u_B = torch.rand(n_B.shape, generator=gen)
        cut_B = (u_B * n_B).floor().long() + 1  # Uniform{1..n}
        pi_BT = (n_B[:, None] - pos_BT + 1).double() / n_B.clamp_min(1)[:, None].double()
        keep_BT = pos_BT <= cut_B[:, None]
        w_BT = torch.where(keep_BT, 1 / pi_BT.clamp_min(1e-12), torch.zeros_like(pi_BT))
    else:
        raise ValueError(f"nat.scheme must be 'urs' or 'rpc', got {p.scheme!r}")
    return _apply(ctx, w_BT, "nat")


# --- prefix_focus (PPPO) -----------------------------------------------------------------


@dataclass(frozen=True)
class PrefixFocusParams:
    start_frac: float = 0.25
    """Fraction of each response's loss tokens (from its start) trained at step 0."""
    ramp_steps: int = 100
    """The fraction grows linearly to 1 over this many optimizer steps."""


def prefix_focus(ctx: TokenContext, p: PrefixFocusParams) -> WeightOutputs:
    """PPPO progressive prefix retention: the loss covers a growing prefix of each response.

        rho(step) = f_0 + (1 - f_0) min(step / S, 1);   w_j = 1[j <= ceil(rho n)]

    with j the 1-based position among the response's n loss tokens. PPPO (Progressive Prefix-token
    Policy Optimization), "Well Begun, Half Done: Reinforcement Learning with Prefix Optimization
    for LLM Reasoning", Sun et al. 2025, arXiv:2512.15274 (the Beginning Lock-in Effect). The
    abstract gives no numbers: f_0 = 0.25, S = 100 are this library's defaults. At rho = 1 this is
    GRPO.
    """
    ramp = min(ctx.step / p.ramp_steps, 1.0) if p.ramp_steps > 0 else 1.0
    rho = p.start_frac + (1 - p.start_frac) * ramp
    mask_BT = ctx.loss_mask_BT.bool()
    pos_BT = torch.cumsum(mask_BT.long(), dim=1)
    limit_B = torch.ceil(rho * mask_BT.sum(dim=1).double() - 1e-9)
    return _apply(ctx, (pos_BT <= limit_B[:, None]).float(), "prefix_focus", frac=rho)


# --- delta_logp --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaLogpParams:
    alpha: float = 1.0
    """Extra weight of a token of probability 0 over one of probability 1."""


def delta_logp(ctx: TokenContext, p: DeltaLogpParams) -> WeightOutputs:
    """Focus on low-probability tokens, the ones RLVR's signed log-prob change favours.

        w_t = 1 + alpha (1 - p_old(y_t)),  then normalized to mean 1 over the loss tokens

    "On the Direction of RLVR Updates for LLM Reasoning: Identification and Exploitation", Huang et
    al. 2026, arXiv:2603.22117 ("a training-time reweighting method that focuses learning on
    low-probability (higher Delta log p) tokens"). The abstract gives no formula; this linear form
    with alpha = 1 is this library's. The normalization keeps the gradient scale of GRPO; alpha = 0
    is GRPO.
    """
    mask_BT = ctx.loss_mask_BT.bool()
    w_BT = 1 + p.alpha * (1 - ctx.old_logprobs_BT.double().exp())
    mean = float(w_BT[mask_BT].mean()) if mask_BT.any() else 1.0
    return _apply(ctx, w_BT / mean, "delta_logp")


# --- balanced (BA aggregation) -----------------------------------------------------------


def balanced(ctx: TokenContext, p: NoParams) -> WeightOutputs:
    """Balanced aggregation (BA): the token means of the positive and negative subsets, then
    their average, as token weights for `token_mean`.

        w_t = N / (2 N_+) for A_t > 0,   N / (2 N_-) for A_t < 0,   1 for A_t = 0

    With `token_mean` (sum / N over the step's N loss tokens) the loss becomes
    (1/2) sum_{+} l / N_+ + (1/2) sum_{-} l / N_- (+ zero-advantage terms / N): positive and
    negative tokens weigh the same in total whatever their counts (long failed answers no longer
    dominate). Computed on the whole step batch, so gradient accumulation is exact. A step
    without negative (or positive) tokens gets weight N / (2 N_+) on the positive ones only.
    "Balanced Aggregation: Understanding and Fixing Aggregation Bias in GRPO", Zeng et al. 2026,
    arXiv:2605.04077; the paper combines the two subset means with sequence-count-based weights,
    this part with equal weights (1/2 each).
    """
    mask_BT = ctx.loss_mask_BT.bool()
    n = float(mask_BT.sum())
    pos_BT, neg_BT = mask_BT & (ctx.advantages_BT > 0), mask_BT & (ctx.advantages_BT < 0)
    n_pos, n_neg = float(pos_BT.sum()), float(neg_BT.sum())
    w_BT = torch.ones(mask_BT.shape, dtype=torch.float64)
    if n_pos:
        w_BT = torch.where(pos_BT, n / (2 * n_pos), w_BT)
    if n_neg:
        w_BT = torch.where(neg_BT, n / (2 * n_neg), w_BT)
    return _apply(ctx, w_BT, "balanced", pos_tokens=n_pos, neg_tokens=n_neg)


# --- registry ----------------------------------------------------------------------------

WeightFn = Callable[[TokenContext, Any], WeightOutputs]

WEIGHT_PARAMS: dict[str, type] = {
    "high_entropy_only": HighEntropyParams,
    "entropy_gate": EntropyGateParams,
    "entropy_weighted": EntropyWeightedParams,
    "surprisal_reweight": SurprisalParams,
    "entropy_change": EntropyChangeParams,
    "uncertainty_shaping": UncertaintyParams,
    "d3s": D3SParams,
    "nat": NatParams,
    "prefix_focus": PrefixFocusParams,
    "delta_logp": DeltaLogpParams,
    "balanced": NoParams,
}

WEIGHTS: dict[str, WeightFn] = {
    "high_entropy_only": high_entropy_only,
    "entropy_gate": entropy_gate,
    "entropy_weighted": entropy_weighted,
    "surprisal_reweight": surprisal_reweight,
    "entropy_change": entropy_change,
    "uncertainty_shaping": uncertainty_shaping,
    "d3s": d3s,
    "nat": nat,
    "prefix_focus": prefix_focus,
    "delta_logp": delta_logp,
    "balanced": balanced,
}
"""Token weight parts by name (`TrainerSettings.token_weights`, applied in order)."""


def apply_weight(
    name: str, ctx: TokenContext, overrides: Mapping[str, Any] | None = None
) -> WeightOutputs:
    """Run the weight part `name` with its paper defaults overridden by `overrides`."""
    return WEIGHTS[name](ctx, resolve(WEIGHT_PARAMS[name], overrides, name))
