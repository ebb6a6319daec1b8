"""Advantage estimators: per-sample scalar rewards -> per-sample advantages, by group.

Every estimator has the signature `(AdvantageInputs, AdvantageConfig) -> AdvantageOutputs` and is
registered in `ADVANTAGES` under the name `TrainerSettings.advantage` uses. To add one: write the
function here (or in a sibling module) and add one registry line.

Shapes: B = samples in the step; rewards and group indices are (B,). Groups are given by
`group_index_B` (0..G-1), so partial groups of different sizes mix freely.

Numerics (BUG-12): group statistics are computed in float64 with a two-pass variance clamped at 0,
so identical rewards give a variance of exactly 0 (never a negative residue or NaN). A group whose
reward std is below `std_floor`, or that has a single member, has no learning signal: its
advantages are exactly 0 and it is counted in `adv/frac_reward_zero_std`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    rewards_B: Tensor
    """(B,) combined scalar reward of each sample (any float dtype)."""
    group_index_B: Tensor
    """(B,) int64 group of each sample, 0..G-1."""


@dataclass(frozen=True)
class AdvantageConfig:
    std_floor: float = 1e-3
    """Group reward std (unbiased) below this is treated as 0: advantages 0 for that group."""


@dataclass(frozen=True)
class AdvantageOutputs:
    advantages_B: Tensor
    """(B,) float32 advantage of each sample (spread over its sampled tokens by the batch)."""
    metrics: dict[str, float]
    """`adv/mean`, `adv/max_abs`, `adv/frac_reward_zero_std` (fraction of groups), `adv/groups`."""


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

    DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, section 4.1.2. std is the unbiased group
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

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"); Ahmadian et al. 2024,
    arXiv:2402.14740. No std division, so a 7-vs-1 group of 0.35s and a 0.0 gives the singleton
    exactly 0.0 - 0.35 = -0.35 (BUG-12 case A).
    """

    def leave_one_out(r: Tensor, mean: float, std: float) -> Tensor:
        n = r.numel()
        return r - (r.sum() - r) / (n - 1)

    return _per_group(inputs, cfg, leave_one_out)


AdvantageFn = Callable[[AdvantageInputs, AdvantageConfig], AdvantageOutputs]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
}
"""Advantage estimators by `TrainerSettings.advantage`."""
