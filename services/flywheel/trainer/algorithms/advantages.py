"""Advantage estimators: per-sample rewards (and, for distillation, per-token teacher logprobs)
-> advantages, by group.

Every estimator has the signature `(AdvantageInputs, AdvantageConfig) -> AdvantageOutputs` and is
registered in `ADVANTAGES` under the name `TrainerSettings.advantage` uses. To add one: write the
function here (or in a sibling module) and add one registry line.

Shapes: B = samples in the step, T = tokens (right-padded, aligned with `token_ids` as in
`LossInputs`); rewards and group indices are (B,). Groups are given by `group_index_B` (0..G-1),
so partial groups of different sizes mix freely.

Input contract: `rewards_B` and `group_index_B` are always given. The per-token fields of
`AdvantageInputs` are optional and default to None; an estimator that needs them (`opd`,
`opd_plus_rl`: `teacher_logprobs_BT`, `rollout_logprobs_BT`, `teacher_mask_BT`) raises ValueError
when they are missing, and `catalog.py` lists what each estimator reads. Sequence-level
estimators return `advantages_B` only; token-level ones also return `advantages_BT`, which then
takes precedence over `advantages_B` when the batch spreads advantages over tokens.

Numerics (BUG-12): group statistics are computed in float64 with a two-pass variance clamped at 0,
so identical rewards give a variance of exactly 0 (never a negative residue or NaN). A group whose
reward std is below `std_floor`, or that has a single member, has no learning signal: its
advantages are exactly 0 and it is counted in `adv/frac_reward_zero_std`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flywheel.trainer.algorithms.params import NoParams, resolve


@dataclass(frozen=True)
class AdvantageInputs:
    rewards_B: Tensor
    """(B,) combined scalar reward of each sample (any float dtype)."""
    group_index_B: Tensor
    """(B,) int64 group of each sample, 0..G-1."""
    teacher_logprobs_BT: Tensor | None = None
    """(B, T) teacher logprob of each sampled token (e.g. under a hinted context); any value
    where `teacher_mask_BT` is False. Needed by `opd`, `opd_plus_rl`."""
    rollout_logprobs_BT: Tensor | None = None
    """(B, T) student logprob of each sampled token as the rollout engine reported it."""
    teacher_mask_BT: Tensor | None = None
    """(B, T) bool: True where a teacher logprob exists for a trained token. None = wherever
    `teacher_logprobs_BT` is finite."""
    token_ids_BT: Tensor | None = None
    """(B, T) int64 token ids (right-padded). Needed by `tempo`, `ktae`."""
    loss_mask_BT: Tensor | None = None
    """(B, T) bool: True on sampled (trained) tokens. Needed by every token-level estimator."""
    entropy_BT: Tensor | None = None
    """(B, T) detached predictive entropy (nats) under the current weights; given only to
    estimators that declare it (`zero_variance`, `miner`): the step scores the batch for it."""
    turn_index_B: Tensor | None = None
    """(B,) int64 turn of each sample within its episode (`turn_level`)."""
    step_rewards_BT: Tensor | None = None
    """(B, T) per-step (PRM / judge) score placed on the last token of each step, NaN
    elsewhere (`segment`)."""
    wrong_hint_logprobs_BT: Tensor | None = None
    """(B, T) teacher logprob of each token under a wrong hint (`contrastive_sd`)."""


@dataclass(frozen=True)
class AdvantageConfig:
    std_floor: float = 1e-3
    """Group reward std (unbiased) below this is treated as 0: advantages 0 for that group."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the estimator's own parameter dataclass (`ADVANTAGE_PARAMS`), from
    `[trainer.algorithm.params.<name>]`."""
    part_params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Every part's overrides (`algorithm_params`), for an estimator that runs another one
    (`opd_plus_rl`: its `rl_advantage`)."""


@dataclass(frozen=True)
class QuantileParams:
    k: float = 0.5
    """K of the `quantile` baseline, in [0, 1]; 0.5 = the (lower) group median."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.k <= 1.0:
            raise ValueError(f"k of 'quantile' must be in [0, 1], got {self.k}")


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "quantile")
"""Sequence-level group estimators (the `rl_advantage` choices of `opd_plus_rl`)."""


@dataclass(frozen=True)
class OPDPlusRLParams:
    opd_weight: float = 1.0
    """w_opd (weight of the teacher - student token gap)."""
    rl_weight: float = 1.0
    """w_rl (weight of the group reward advantage)."""
    rl_advantage: str = "grpo"
    """Group estimator for the reward part: one of GROUP_ESTIMATORS (its own parameters, e.g.
    `[trainer.algorithm.params.quantile]`, apply). Live turns (`live_advantage =
    "opd_plus_rl"`) use their own reward r instead: a judge's +1/-1 is already centred."""
    gap_clip: float = 0.0
    """Clip of the teacher - student logprob gap to [-gap_clip, gap_clip] nats before w_opd
    (OpenClaw-RL's second version); 0 = off."""
    student_topk: int = 0
    """Keep the distillation term only where the sampled token is among the student's k most
    likely tokens (OpenClaw-RL's second version; ranked by the policy once per step,
    `opd_topk.py`); 0 = off."""

    def __post_init__(self) -> None:
        if self.student_topk < 0:
            raise ValueError(
                f"student_topk of 'opd_plus_rl' must be >= 0 (0 = off), got {self.student_topk}"
            )
        if self.gap_clip < 0:
            raise ValueError(
                f"gap_clip of 'opd_plus_rl' must be >= 0 (0 = off), got {self.gap_clip}"
            )
        if self.rl_advantage not in GROUP_ESTIMATORS:
            raise ValueError(
                f"rl_advantage of 'opd_plus_rl' must be one of {list(GROUP_ESTIMATORS)}, "
                f"got {self.rl_advantage!r}"
            )


@dataclass(frozen=True)
class AdvantageOutputs:
    advantages_B: Tensor
    """(B,) float32 advantage of each sample (spread over its sampled tokens by the batch)."""
    metrics: dict[str, float]
    """`adv/mean`, `adv/max_abs`, `adv/frac_reward_zero_std` (fraction of groups), `adv/groups`."""
    advantages_BT: Tensor | None = None
    """(B, T) float32 per-token advantage for token-level estimators; None for sequence-level
    ones (the batch then spreads `advantages_B` over each sample's loss tokens)."""


def _group_stats(rewards: Tensor) -> tuple[float, float]:
    """Mean and unbiased std of one group's float64 rewards (two-pass, variance >= 0)."""
    n = rewards.numel()
    mean = rewards.sum() / n
    if n < 2:
        return float(mean), 0.0
    var = ((rewards - mean) ** 2).sum() / (n - 1)
    return float(mean), float(var.clamp_min(0.0).sqrt())


def _per_group(
    inputs: AdvantageInputs,
    cfg: AdvantageConfig,
    centred: Callable[[Tensor, float, float], Tensor],
) -> AdvantageOutputs:
    """Apply `centred(rewards_n, mean, std) -> adv_n` to every group that has a reward spread."""
    rewards_B = inputs.rewards_B.to(torch.float64)
    adv_B = torch.zeros_like(rewards_B)
    groups = torch.unique(inputs.group_index_B)
    zero_std = 0
    for g in groups.tolist():
        idx = (inputs.group_index_B == g).nonzero(as_tuple=True)[0]
        rewards_n = rewards_B[idx]
        mean, std = _group_stats(rewards_n)
        if rewards_n.numel() < 2 or std < cfg.std_floor:
            zero_std += 1
            continue
        adv_B[idx] = centred(rewards_n, mean, std)
    adv32_B = adv_B.to(torch.float32)
    metrics = {
        "adv/mean": float(adv32_B.mean()) if adv32_B.numel() else 0.0,
        "adv/max_abs": float(adv32_B.abs().max()) if adv32_B.numel() else 0.0,
        "adv/frac_reward_zero_std": zero_std / max(len(groups), 1),
        "adv/groups": float(len(groups)),
    }
    return AdvantageOutputs(advantages_B=adv32_B, metrics=metrics)


def grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutputs:
    """GRPO outcome advantage: A_i = (r_i - mean(r_G)) / std(r_G).

    "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", Shao
    et al. 2024, arXiv:2402.03300, section 4.1.2. std is the unbiased group
    std; with it |A_i| <= (n - 1) / sqrt(n) for any group of n, so a guarded std cannot blow up.
    """
    return _per_group(inputs, cfg, lambda r, mean, std: (r - mean) / std)


def dr_grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutputs:
    """Dr. GRPO advantage: A_i = r_i - mean(r_G) (no std division, removing its difficulty bias).

    "Understanding R1-Zero-Like Training: A Critical Perspective", Liu et al. 2025,
    arXiv:2503.20783. Groups without reward spread (std < floor) still get exactly 0.
    """
    return _per_group(inputs, cfg, lambda r, mean, std: r - mean)


def rloo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutputs:
    """REINFORCE leave-one-out: A_i = r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) (r_i - mean).

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (ICLR 2019 workshop; arXiv
    id not confirmed); Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs", arXiv:2402.14740. No std division, so a
    7-vs-1 group of 0.35s and a 0.0 gives the singleton exactly 0.0 - 0.35 = -0.35 (BUG-12 case A).
    """

    def leave_one_out(r: Tensor, mean: float, std: float) -> Tensor:
        n = r.numel()
        return r - (r.sum() - r) / (n - 1)

    return _per_group(inputs, cfg, leave_one_out)


def _lower_quantile(sorted_n: Tensor, k: float) -> Tensor:
    """Inverse-CDF K-quantile of sorted values: the smallest r_(j) with j / n >= K (1-based)."""
    n = sorted_n.numel()
    j = min(max(math.ceil(k * n) - 1, 0), n - 1)
    return sorted_n[j]


def quantile(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutputs:
    """Quantile Advantage Estimation (QAE): A_i = (r_i - Q_K(r_G)) / std(r_G).

    "Quantile Advantage Estimation for Entropy-Safe Reasoning", Wu et al. 2025,
    arXiv:2509.22611: the group mean baseline of GRPO/DAPO is replaced by the group K-quantile,
    std normalization kept. Q_K is the inverse-CDF quantile (smallest r_(j), j = ceil(K n)), so
    for binary rewards with success rate p the baseline is 0 when p <= 1 - K (only the rare
    successes get signal) and 1 when p > 1 - K (only the remaining failures do): the paper's
    two-regime gate. K = 0.5 is the lower median (as `torch.median`); the paper tunes K per
    model (`[trainer.algorithm.params.quantile] k`). Groups without reward spread get exactly 0
    (BUG-12).
    """
    k = resolve(QuantileParams, cfg.params, "quantile").k

    def centred(r: Tensor, mean: float, std: float) -> Tensor:
        baseline = _lower_quantile(torch.sort(r).values, k)
        return (r - baseline) / std

    return _per_group(inputs, cfg, centred)


def _teacher_gap(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(B, T) float32 teacher - rollout logprob gap, exactly 0 where there is no teacher; mask."""
    teacher_BT, rollout_BT = inputs.teacher_logprobs_BT, inputs.rollout_logprobs_BT
    if teacher_BT is None or rollout_BT is None:
        raise ValueError("opd needs teacher_logprobs_BT and rollout_logprobs_BT (B, T)")
    if teacher_BT.shape != rollout_BT.shape:
        raise ValueError(f"teacher {tuple(teacher_BT.shape)} != rollout {tuple(rollout_BT.shape)}")
    mask_BT = inputs.teacher_mask_BT
    mask_BT = torch.isfinite(teacher_BT) if mask_BT is None else mask_BT.bool()
    gap_BT = (teacher_BT.double() - rollout_BT.double()).to(torch.float32)  # (B, T)
    return torch.where(mask_BT, gap_BT, torch.zeros_like(gap_BT)), mask_BT


def _token_metrics(adv_BT: Tensor, mask_BT: Tensor, groups: int) -> dict[str, float]:
    selected = adv_BT[mask_BT]
    return {
        "adv/mean": float(selected.mean()) if selected.numel() else 0.0,
        "adv/max_abs": float(selected.abs().max()) if selected.numel() else 0.0,
        "adv/frac_reward_zero_std": 0.0,
        "adv/groups": float(groups),
        "adv/teacher_token_frac": float(mask_BT.float().mean()) if mask_BT.numel() else 0.0,
    }


def _per_sample_mean(adv_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """(B,) mean of each sample's advantage over its teacher tokens (0 without any)."""
    return adv_BT.sum(dim=1) / mask_BT.sum(dim=1).clamp_min(1).to(adv_BT.dtype)


def opd(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutputs:
    """On-policy distillation token advantage: A_t = log p_teacher(y_t) - log p_student(y_t).

    The per-token reverse-KL signal of on-policy distillation (Agarwal et al. 2024, "On-Policy
    Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649;
    Thinking Machines "On-Policy Distillation" 2025, blog, no arXiv id), used as a per-token
    advantage with the student's rollout logprob as in OpenClaw-RL's hindsight OPD ("OpenClaw-RL:
    Train Any Agent Simply by Talking", arXiv:2603.10165). The student term is the rollout logprob
    (the behaviour policy that sampled y_t), so the advantage is a constant w.r.t. the trained
    weights. Tokens without a teacher logprob get exactly 0. No groups: works for group-less (live)
    samples. Shapes: (B, T) in, `advantages_BT` (B, T) out; `advantages_B` is each sample's mean
    over its teacher tokens (for metrics).
    """
    gap_BT, mask_BT = _teacher_gap(inputs)
    groups = int(torch.unique(inputs.group_index_B).numel())
    return AdvantageOutputs(
        advantages_B=_per_sample_mean(gap_BT, mask_BT),
        metrics=_token_metrics(gap_BT, mask_BT, groups),
        advantages_BT=gap_BT,
    )


def opd_plus_rl(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutputs:
    """OPD + RL: A_t = w_opd (log p_teacher(y_t) - log p_student(y_t)) + w_rl A_group(i).

    OpenClaw-RL's combined objective ("OpenClaw-RL: Train Any Agent Simply by Talking",
    arXiv:2603.10165): the distillation gap where a teacher token exists, plus
    the sequence's group reward advantage (`rl_advantage`, default grpo) on every token.
    With w_opd = 0 it reduces to the group estimator spread over tokens; with w_rl = 0 to `opd`.
    Shapes: (B,) rewards and (B, T) teacher/rollout logprobs in, `advantages_BT` (B, T) out.
    """
    p = resolve(OPDPlusRLParams, cfg.params, "opd_plus_rl")
    gap_BT, mask_BT = _teacher_gap(inputs)
    gap_BT = clip_gap(gap_BT, p.gap_clip)
    rl_cfg = dataclasses.replace(cfg, params=cfg.part_params.get(p.rl_advantage, {}))
    rl = ADVANTAGES[p.rl_advantage](inputs, rl_cfg)
    adv_BT = p.opd_weight * gap_BT + p.rl_weight * rl.advantages_B[:, None]  # (B, T)
    metrics = rl.metrics | {
        "adv/opd_mean": _token_metrics(gap_BT, mask_BT, 0)["adv/mean"],
        "adv/teacher_token_frac": float(mask_BT.float().mean()) if mask_BT.numel() else 0.0,
        "adv/max_abs": float(adv_BT.abs().max()) if adv_BT.numel() else 0.0,
    }
    return AdvantageOutputs(
        advantages_B=p.opd_weight * _per_sample_mean(gap_BT, mask_BT)
        + p.rl_weight * rl.advantages_B,
        metrics=metrics,
        advantages_BT=adv_BT.to(torch.float32),
    )


def clip_gap(gap_BT: Tensor, gap_clip: float) -> Tensor:
    """(B, T) teacher - student logprob gap clipped to [-gap_clip, gap_clip] nats (0 = off)."""
    return gap_BT.clamp(-gap_clip, gap_clip) if gap_clip > 0 else gap_BT


def live_opd_plus_rl(
    inputs: AdvantageInputs, has_reward_B: Tensor, params: OPDPlusRLParams
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """OpenClaw-RL's combined advantage on live turns, per response token:

        A_t = w_opd * [teacher_i] * clip(log pi_teacher(a_t | s + hint) - log pi_old(a_t | s))
              + w_rl * [reward_i] * r_i

    ("OpenClaw-RL: Train Any Agent Simply by Talking", arXiv:2603.10165, the combined
    objective; used inside the PPO clipped surrogate by the policy loss). pi_old is the rollout
    logprob the gateway recorded; clip is `gap_clip` (0 = off). A turn with only one signal
    uses that one ([teacher_i]: some token has a teacher logprob; [reward_i]: the judge scored
    it, `Sample.has_reward`); a turn with neither gets 0 everywhere and is reported in
    `no_signal_B` for the caller to drop and count. Tokens without a teacher logprob get only
    the reward term.

    Args:
        inputs: `rewards_B` (B,), `teacher_logprobs_BT`, `rollout_logprobs_BT`,
            `teacher_mask_BT`, `loss_mask_BT` (B, T).
        has_reward_B: (B,) bool, the judge's verdict exists.
        params: weights and gap clip (`[trainer.algorithm.params.opd_plus_rl]`).

    Returns:
        (advantages_BT (B, T) float32, no_signal_B (B,) bool, metrics `adv/mean`,
        `adv/opd_mean`, `adv/teacher_token_frac`, `adv/max_abs`, `adv/both_signals`,
        `adv/reward_only`, `adv/opd_only`).

    Raises:
        ValueError: a teacher input is missing.
    """
    gap_BT, mask_BT = _teacher_gap(inputs)
    gap_BT = clip_gap(gap_BT, params.gap_clip)
    has_teacher_B = mask_BT.any(dim=1)
    has_reward_B = has_reward_B.bool()
    reward_B = torch.where(has_reward_B, inputs.rewards_B.double(), 0.0)
    adv_BT = params.opd_weight * gap_BT + params.rl_weight * reward_B[:, None]
    loss_BT = mask_BT if inputs.loss_mask_BT is None else inputs.loss_mask_BT.bool()
    adv_BT = torch.where(loss_BT, adv_BT, 0.0)
    no_signal_B = ~has_teacher_B & ~has_reward_B
    metrics = {
        "adv/mean": float(adv_BT[loss_BT].mean()) if loss_BT.any() else 0.0,
        "adv/opd_mean": _token_metrics(gap_BT, mask_BT, 0)["adv/mean"],
        "adv/teacher_token_frac": float(mask_BT.float().mean()) if mask_BT.numel() else 0.0,
        "adv/max_abs": float(adv_BT.abs().max()) if adv_BT.numel() else 0.0,
        "adv/both_signals": float((has_teacher_B & has_reward_B).sum()),
        "adv/reward_only": float((~has_teacher_B & has_reward_B).sum()),
        "adv/opd_only": float((has_teacher_B & ~has_reward_B).sum()),
    }
    return adv_BT.to(torch.float32), no_signal_B, metrics


AdvantageFn = Callable[[AdvantageInputs, AdvantageConfig], AdvantageOutputs]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "quantile": quantile,
    "opd": opd,
    "opd_plus_rl": opd_plus_rl,
}
"""Advantage estimators by `TrainerSettings.advantage`."""

from flywheel.trainer.algorithms.advantages_token import (  # noqa: E402
    TOKEN_ADVANTAGE_PARAMS,
    TOKEN_ADVANTAGES,
)

ADVANTAGES.update(TOKEN_ADVANTAGES)

ADVANTAGE_PARAMS: dict[str, type] = {
    "grpo": NoParams,
    "dr_grpo": NoParams,
    "rloo": NoParams,
    "quantile": QuantileParams,
    "opd": NoParams,
    "opd_plus_rl": OPDPlusRLParams,
    **TOKEN_ADVANTAGE_PARAMS,
}
"""Parameter dataclass of every estimator (`NoParams`: takes none; the group std floor of
every group estimator is `trainer.algorithm.std_floor`)."""
