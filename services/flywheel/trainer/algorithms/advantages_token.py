"""Token-level advantage estimators: rewards plus per-token signals -> advantages (B, T).

Same signature as the group estimators in `advantages.py`: `(AdvantageInputs, AdvantageConfig)
-> AdvantageOutputs`, with `advantages_BT` set. Each reads its own parameter dataclass from
`cfg.params` (`[trainer.algorithm.params.<name>]`), with the paper's defaults where the paper
gives them and this library's otherwise (said in each docstring).

Shapes: B = samples, T = tokens (right-padded, aligned with token_ids); rewards, group and turn
indices (B,). Every output is exactly 0 off `loss_mask_BT` (prompt and padding). The sequence
part of every estimator is the guarded GRPO advantage (BUG-12: no NaN on all-equal rewards or
single-member groups), so with its extra term switched off each reduces to GRPO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flywheel.trainer.algorithms import advantages as adv
from flywheel.trainer.algorithms.params import NoParams, resolve


def _need(inputs: adv.AdvantageInputs, name: str, part: str) -> Tensor:
    value = getattr(inputs, name)
    if value is None:
        raise ValueError(f"{part} needs {name} in AdvantageInputs")
    return value


def _mask(inputs: adv.AdvantageInputs, part: str) -> Tensor:
    return _need(inputs, "loss_mask_BT", part).bool()


def _grpo_B(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    return adv.grpo(inputs, cfg)


def _group_std_B(inputs: adv.AdvantageInputs) -> Tensor:
    """(B,) unbiased reward std of each sample's group (0 for single members)."""
    std_B = torch.zeros(inputs.rewards_B.shape[0], dtype=torch.float64)
    for g in torch.unique(inputs.group_index_B).tolist():
        idx = (inputs.group_index_B == g).nonzero(as_tuple=True)[0]
        std_B[idx] = adv._group_stats(inputs.rewards_B[idx].double())[1]
    return std_B


def _out(
    base: adv.AdvantageOutputs, adv_BT: Tensor, mask_BT: Tensor, **extra: float
) -> adv.AdvantageOutputs:
    adv_BT = torch.where(mask_BT, adv_BT.float(), torch.zeros_like(adv_BT, dtype=torch.float32))
    n_B = mask_BT.sum(dim=1).clamp_min(1)
    selected = adv_BT[mask_BT]
    metrics = (
        base.metrics
        | {
            "adv/token_mean": float(selected.mean()) if selected.numel() else 0.0,
            "adv/max_abs": float(selected.abs().max()) if selected.numel() else 0.0,
        }
        | extra
    )
    return adv.AdvantageOutputs(
        advantages_B=adv_BT.sum(dim=1) / n_B, metrics=metrics, advantages_BT=adv_BT
    )


def _spread(adv_B: Tensor, mask_BT: Tensor) -> Tensor:
    return adv_B.double()[:, None].expand(mask_BT.shape).clone()


# --- tempo -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TempoParams:
    td_weight: float = 1.0
    """Weight of the TD correction at branch tokens (0 = GRPO)."""


def tempo(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """TEMPO / prefix-to-tree: group responses form a prefix tree; branch tokens get a TD term.

        V(u)       = mean reward of the group's responses whose sampled tokens start with u
        A_{i,t}    = A_i^GRPO + beta 1[u_{<t} branches] (V(u_{<=t}) - V(u_{<t})) / std_G(r)

    u_{<t} is response i's sampled prefix before token t (the tree's node); a node branches when the
    group's responses continue it with two or more different tokens. Off branch points the two
    values are equal (same responses), so the TD term is exactly 0 there: credit goes only to the
    decision tokens. TEMPO / Prefix-to-Tree: "Exploiting Tree Structure for Credit Assignment in RL
    Training of LLMs", Tran et al. 2025, arXiv:2509.18314; beta = 1 is this library's default.
    Groups without reward spread get exactly 0 (as GRPO).
    """
    p = resolve(TempoParams, cfg.params, "tempo")
    mask_BT = _mask(inputs, "tempo")
    ids_BT = _need(inputs, "token_ids_BT", "tempo")
    base = _grpo_B(inputs, cfg)
    adv_BT = _spread(base.advantages_B, mask_BT)
    rewards_B = inputs.rewards_B.double()
    std_B = _group_std_B(inputs)
    branch_tokens = 0
    for g in torch.unique(inputs.group_index_B).tolist():
        idx = (inputs.group_index_B == g).nonzero(as_tuple=True)[0].tolist()
        if len(idx) < 2 or float(std_B[idx[0]]) < cfg.std_floor:
            continue
        node_of: dict[tuple[int, int], int] = {}
        total: dict[int, float] = {0: 0.0}
        count: dict[int, int] = {0: 0}
        children: dict[int, set[int]] = {}
        paths: dict[int, list[tuple[int, int]]] = {}
        for i in idx:
            positions = mask_BT[i].nonzero(as_tuple=True)[0].tolist()
            node = 0
            total[0] += float(rewards_B[i])
            count[0] += 1
            path = []
            for t in positions:
                key = (node, int(ids_BT[i, t]))
                child = node_of.setdefault(key, len(node_of) + 1)
                children.setdefault(node, set()).add(child)
                total[child] = total.get(child, 0.0) + float(rewards_B[i])
                count[child] = count.get(child, 0) + 1
                path.append((t, node))
                node = child
            paths[i] = path
        for i in idx:
            for t, parent in paths[i]:
                if len(children.get(parent, ())) < 2:
                    continue
                child = node_of[(parent, int(ids_BT[i, t]))]
                td = total[child] / count[child] - total[parent] / count[parent]
                adv_BT[i, t] += p.td_weight * td / float(std_B[i])
                branch_tokens += 1
    return _out(base, adv_BT, mask_BT, **{"adv/branch_tokens": float(branch_tokens)})


# --- ktae --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KtaeParams:
    weight: float = 1.0
    """beta: weight of the token importance added to the rollout advantage."""


def ktae(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """KTAE: token importance from occurrence in correct vs incorrect rollouts of the group.

        correct_i  = r_i > mean_G(r)
        imp_G(v)   = (#correct responses containing v) / (#correct)
                     - (#incorrect responses containing v) / (#incorrect)        in [-1, 1]
        A_{i,t}    = A_i^GRPO + beta imp_G(y_t)

    "KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation in Mathematical Reasoning",
    Sun et al. 2025, arXiv:2505.16826. The paper scores a token's association with correctness
    from its 2x2 contingency table (correct/incorrect x contains/not); the difference of
    presence rates used here is that table's simplest signed statistic. beta = 1 is this
    library's default. Tokens used equally often by both sides get exactly the GRPO advantage;
    groups without reward spread get 0.
    """
    p = resolve(KtaeParams, cfg.params, "ktae")
    mask_BT = _mask(inputs, "ktae")
    ids_BT = _need(inputs, "token_ids_BT", "ktae")
    base = _grpo_B(inputs, cfg)
    adv_BT = _spread(base.advantages_B, mask_BT)
    rewards_B = inputs.rewards_B.double()
    for g in torch.unique(inputs.group_index_B).tolist():
        idx = (inputs.group_index_B == g).nonzero(as_tuple=True)[0].tolist()
        mean, std = adv._group_stats(rewards_B[idx])
        if len(idx) < 2 or std < cfg.std_floor:
            continue
        sets = {i: set(ids_BT[i][mask_BT[i]].tolist()) for i in idx}
        good = [i for i in idx if float(rewards_B[i]) > mean]
        bad = [i for i in idx if float(rewards_B[i]) <= mean]
        vocab = set().union(*sets.values())
        imp = {
            v: sum(v in sets[i] for i in good) / len(good)
            - sum(v in sets[i] for i in bad) / len(bad)
            for v in vocab
        }
        for i in idx:
            for t in mask_BT[i].nonzero(as_tuple=True)[0].tolist():
                adv_BT[i, t] += p.weight * imp[int(ids_BT[i, t])]
    return _out(base, adv_BT, mask_BT)


# --- zero_variance (RL-ZVP) --------------------------------------------------------------


@dataclass(frozen=True)
class ZeroVarianceParams:
    alpha: float = 0.1
    """Scale of the entropy-shaped advantage of zero-variance groups."""
    correct_threshold: float = 0.5
    """An all-equal group with reward above this is all-correct, else all-wrong."""


def zero_variance(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """RL-ZVP: learning signal for zero-variance groups, modulated by token entropy.

        groups with reward spread:   A_{i,t} = A_i^GRPO
        all correct:                 A_{i,t} =  alpha H_{i,t}
        all wrong:                   A_{i,t} = -alpha (max_t' H_{i,t'} - H_{i,t})

    Correct responses push up most where the policy was uncertain; wrong ones push down most
    where it was confident. "No Prompt Left Behind: Exploiting Zero-Variance Prompts in LLM
    Reinforcement Learning via Entropy-Guided Advantage Shaping" (RL-ZVP), Le et al. 2025,
    arXiv:2509.21880 (alpha = 0.1). H is detached. With alpha = 0 this is GRPO.
    """
    p = resolve(ZeroVarianceParams, cfg.params, "zero_variance")
    mask_BT = _mask(inputs, "zero_variance")
    h_BT = torch.where(mask_BT, _need(inputs, "entropy_BT", "zero_variance").double(), 0.0)
    base = _grpo_B(inputs, cfg)
    adv_BT = _spread(base.advantages_B, mask_BT)
    std_B = _group_std_B(inputs)
    sizes = torch.bincount(inputs.group_index_B)[inputs.group_index_B]
    zvp_B = (std_B < cfg.std_floor) & (sizes > 1)
    correct_B = inputs.rewards_B.double() > p.correct_threshold
    h_max_B = h_BT.max(dim=1).values
    pos_BT = p.alpha * h_BT
    neg_BT = -p.alpha * (h_max_B[:, None] - h_BT)
    shaped_BT = torch.where(correct_B[:, None], pos_BT, neg_BT)
    adv_BT = torch.where(zvp_B[:, None], shaped_BT, adv_BT)
    return _out(base, adv_BT, mask_BT, **{"adv/zvp_frac": float(zvp_B.double().mean())})


# --- miner -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MinerParams:
    scale: float = 0.5
    """Calibration: intrinsic advantages are scaled to this fraction of the batch's mean |A|
    of verifiable-reward groups (or used as is when there are none)."""
    focal_gamma: float = 2.0
    """gamma of the focal token credit (1 - p_t)^gamma."""


def miner(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """Miner: intrinsic uncertainty reward for all-correct groups, focal token credit.

        u_i      = -mean_t log p_old(y_it)            (response uncertainty, nats)
        all-correct group:  A_i = c (u_i - mean_G(u)) / std_G(u)
        A_{i,t}  = A_i f_t / mean_i(f),  f_t = (1 - p_old(y_t))^gamma     (focal credit)
        other groups: GRPO, unchanged

    "Miner: Mining Intrinsic Mastery for Data-Efficient RL in Large Reasoning Models", Jiang et al.
    2026, arXiv:2601.04731: uncertainty as a self-supervised reward on positive homogeneous prompts,
    focal credit amplifying uncertain tokens, and calibration of intrinsic against verifiable
    advantages (c = scale x the mean |A| of the other groups). gamma = 2 (focal loss), scale 0.5 are
    this library's defaults. Reads rollout logprobs only.
    """
    p = resolve(MinerParams, cfg.params, "miner")
    mask_BT = _mask(inputs, "miner")
    logp_BT = torch.where(mask_BT, _need(inputs, "rollout_logprobs_BT", "miner").double(), 0.0)
    base = _grpo_B(inputs, cfg)
    adv_BT = _spread(base.advantages_B, mask_BT)
    n_B = mask_BT.sum(dim=1).clamp_min(1)
    u_B = -logp_BT.sum(dim=1) / n_B
    std_B = _group_std_B(inputs)
    rewarded = base.advantages_B.abs()[std_B >= cfg.std_floor]
    c = p.scale * float(rewarded.mean()) if rewarded.numel() else 1.0
    focal_BT = torch.where(mask_BT, (1 - logp_BT.exp()).clamp_min(0) ** p.focal_gamma, 0.0)
    focal_BT = focal_BT / (focal_BT.sum(dim=1, keepdim=True) / n_B[:, None]).clamp_min(1e-12)
    mined = 0
    for g in torch.unique(inputs.group_index_B).tolist():
        idx = (inputs.group_index_B == g).nonzero(as_tuple=True)[0]
        r = inputs.rewards_B[idx].double()
        if idx.numel() < 2 or float(std_B[idx[0]]) >= cfg.std_floor or float(r.min()) <= 0:
            continue
        mu, sd = adv._group_stats(u_B[idx])
        if sd < 1e-12:
            continue
        a_n = c * (u_B[idx] - mu) / sd
        adv_BT[idx] = a_n[:, None] * focal_BT[idx]
        mined += 1
    return _out(base, adv_BT, mask_BT, **{"adv/mined_groups": float(mined)})


# --- a3po --------------------------------------------------------------------------------


@dataclass(frozen=True)
class A3POParams:
    pos_boost: float = 0.5
    """Extra weight on low-probability tokens of positive samples."""
    neg_boost: float = 0.5
    """Extra weight on high-probability tokens of negative samples."""
    low_prob: float = 0.2
    """p_old below this is a low-probability token."""
    high_prob: float = 0.8
    """p_old above this is a high-probability token."""


def a3po(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """A3PO: asymmetric, polarity-dependent token advantage shaping.

        A > 0:  A_t = A (1 + eta_+ 1[p_t < p_low])     (sharpen: credit rare correct choices)
        A < 0:  A_t = A (1 + eta_- 1[p_t > p_high])    (explore: push confident errors down)

    A3PO (Adaptive and Asymmetric token-level Advantage shaping for Policy Optimization), from
    "Rethinking Sample Polarity in Reinforcement Learning with Verifiable Rewards", Tang et al.
    2025, arXiv:2512.21625. The abstract gives no numbers: eta = 0.5, p_low 0.2, p_high 0.8 are this
    library's defaults, constant over training (the paper's adaptive schedule is not reproduced:
    estimators do not see the step counter). eta = 0 is GRPO.
    """
    p = resolve(A3POParams, cfg.params, "a3po")
    mask_BT = _mask(inputs, "a3po")
    prob_BT = _need(inputs, "rollout_logprobs_BT", "a3po").double().exp()
    base = _grpo_B(inputs, cfg)
    adv_BT = _spread(base.advantages_B, mask_BT)
    w_BT = torch.where(
        adv_BT > 0,
        1 + p.pos_boost * (prob_BT < p.low_prob),
        1 + p.neg_boost * (prob_BT > p.high_prob),
    )
    return _out(base, adv_BT * w_BT, mask_BT)


# --- turn_level --------------------------------------------------------------------------


def turn_level(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """Per-turn advantages for multi-turn episodes (turn-level MDP).

        A_{i,k} = (r_{i,k} - mean_{G,k}(r)) / std_{G,k}(r)

    where (G, k) is the set of samples of group G at turn k: each turn's Sample is compared with the
    same turn of the other episodes of its group, as in turn-PPO ("Turn-PPO: Turn-Level Advantage
    Estimation with PPO for Improved Multi-Turn RL in Agentic LLMs", arXiv:2512.17008) and StepPO
    ("StepPO: Step-Aligned Policy Optimization for Agentic Reinforcement Learning",
    arXiv:2604.18401): the turn, not the token, is the action. Each turn's Sample carries its own
    reward (e.g. a per-turn judge score). With one turn per episode this is exactly GRPO.
    """
    turn_B = _need(inputs, "turn_index_B", "turn_level").long()
    cell_B = inputs.group_index_B.long() * (int(turn_B.max()) + 1 if turn_B.numel() else 1) + turn_B
    _, cell_B = torch.unique(cell_B, return_inverse=True)
    out = adv.grpo(adv.AdvantageInputs(inputs.rewards_B, cell_B), cfg)
    return adv.AdvantageOutputs(
        out.advantages_B,
        out.metrics | {"adv/turn_cells": float(cell_B.max() + 1) if cell_B.numel() else 0.0},
    )


# --- segment (PRM step scores) -----------------------------------------------------------


def segment(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """Per-step PRM / judge scores spread over the step's tokens (process supervision).

        r~_{i,j} = (s_{i,j} - mean_G(s)) / std_G(s)     over every step score of group G
        A_{i,t}  = sum_{j: end(j) >= t} r~_{i,j}        (the normalized scores of the steps
                                                         that end at or after token t)

    DeepSeekMath process supervision (arXiv:2402.03300, section 4.1.3); step-level credit of the
    same shape in CAPO ("CAPO: Towards Enhancing LLM Reasoning through Verifiable Generative Credit
    Assignment", arXiv:2508.02298), SPAE ("Step Potential Advantage Estimation: Harnessing
    Intermediate Confidence and Correctness for Efficient Mathematical Reasoning", arXiv:2601.03823)
    and MA-RLHF ("MA-RLHF: Reinforcement Learning from Human Feedback with Macro Actions",
    arXiv:2410.02743). `step_rewards_BT` holds each step's score on the step's last token and NaN
    elsewhere; in the trainer these are the reward service's "step/<k>" turn scores
    (`samples.step_reward_positions`), and the final turn, which the step judge does not score, gets
    no advantage from this estimator. A group whose step scores are all equal gets exactly 0.
    """
    mask_BT = _mask(inputs, "segment")
    scores_BT = _need(inputs, "step_rewards_BT", "segment").double()
    has_BT = torch.isfinite(scores_BT) & mask_BT
    norm_BT = torch.zeros_like(scores_BT)
    zero = 0
    groups = torch.unique(inputs.group_index_B).tolist()
    for g in groups:
        rows = inputs.group_index_B == g
        sel_BT = has_BT & rows[:, None]
        vals = scores_BT[sel_BT]
        mean, std = adv._group_stats(vals) if vals.numel() else (0.0, 0.0)
        if vals.numel() < 2 or std < cfg.std_floor:
            zero += 1
            continue
        norm_BT[sel_BT] = (vals - mean) / std
    # reverse cumulative sum: tokens get the steps ending at or after them
    adv_BT = torch.flip(torch.cumsum(torch.flip(norm_BT, [1]), 1), [1])
    base = adv.AdvantageOutputs(
        torch.zeros(mask_BT.shape[0]),
        {"adv/frac_reward_zero_std": zero / max(len(groups), 1), "adv/groups": float(len(groups))},
    )
    return _out(base, adv_BT, mask_BT)


# --- self-distillation family: rlsd, sdar_gate, contrastive_sd ---------------------------


def _teacher_ok(inputs: adv.AdvantageInputs, part: str) -> tuple[Tensor, Tensor]:
    """(B, T) bool: loss tokens with a teacher logprob (`teacher_mask_BT`, or wherever the
    teacher logprob is finite when no mask is given); and the loss mask."""
    mask_BT = _mask(inputs, part)
    teacher_BT = _need(inputs, "teacher_logprobs_BT", part)
    tmask_BT = inputs.teacher_mask_BT
    tmask_BT = torch.isfinite(teacher_BT) if tmask_BT is None else tmask_BT.bool()
    return tmask_BT & mask_BT, mask_BT


def _gap(inputs: adv.AdvantageInputs, part: str) -> tuple[Tensor, Tensor]:
    """(B, T) float64 teacher - rollout logprob gap (0 without a teacher) and the loss mask."""
    ok_BT, mask_BT = _teacher_ok(inputs, part)
    teacher_BT = _need(inputs, "teacher_logprobs_BT", part).double()
    rollout_BT = _need(inputs, "rollout_logprobs_BT", part).double()
    return torch.where(ok_BT, teacher_BT - rollout_BT, 0.0), mask_BT


@dataclass(frozen=True)
class RLSDParams:
    beta: float = 1.0
    """Sharpness of the magnitude exp(sign(A) beta gap)."""
    min_weight: float = 0.2
    max_weight: float = 5.0


def rlsd(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """RLSD: direction from the verifiable reward, magnitude from self-distillation gaps.

        d_t     = log p_teacher(y_t | hint) - log p_student(y_t)
        w_t     = clip(exp(sign(A_i) beta d_t), w_min, w_max)  > 0
        A_{i,t} = A_i^GRPO w_t

    The sign of every token's advantage is the reward's (w > 0), so the privileged teacher can never
    flip an update direction (the leakage RLSD avoids); tokens the hinted teacher endorses get more
    credit in correct responses, tokens it rejects more blame in wrong ones. "Self-Distilled RLVR"
    (RLSD), Yang et al. 2026, arXiv:2604.03128. beta = 1 and [0.2, 5] are this library's defaults;
    beta = 0 is GRPO.
    """
    p = resolve(RLSDParams, cfg.params, "rlsd")
    gap_BT, mask_BT = _gap(inputs, "rlsd")
    base = _grpo_B(inputs, cfg)
    adv_BT = _spread(base.advantages_B, mask_BT)
    w_BT = torch.exp(torch.sign(adv_BT) * p.beta * gap_BT).clamp(p.min_weight, p.max_weight)
    return _out(base, adv_BT * w_BT, mask_BT)


@dataclass(frozen=True)
class SDARParams:
    weight: float = 0.5
    """lambda: weight of the gated distillation term."""
    temperature: float = 1.0
    """tau of the sigmoid gate."""


def sdar_gate(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """SDAR: RL advantage plus a sigmoid-gated self-distillation term.

        g_t     = sigmoid(d_t / tau)      (detached; d_t = teacher - student logprob)
        A_{i,t} = A_i^GRPO + lambda g_t d_t

    Positive gaps (teacher endorses the token) pass almost fully (g -> 1); negative ones (teacher
    rejections) are softly attenuated (g -> 0). "Self-Distilled Agentic Reinforcement Learning"
    (SDAR), Lu et al. 2026, arXiv:2605.15155. lambda = 0.5, tau = 1 are this library's defaults;
    lambda = 0 is GRPO.
    """
    p = resolve(SDARParams, cfg.params, "sdar_gate")
    gap_BT, mask_BT = _gap(inputs, "sdar_gate")
    base = _grpo_B(inputs, cfg)
    gate_BT = torch.sigmoid(gap_BT / p.temperature)
    adv_BT = _spread(base.advantages_B, mask_BT) + p.weight * gate_BT * gap_BT
    return _out(
        base,
        adv_BT,
        mask_BT,
        **{"adv/sdar_gate_mean": float(gate_BT[mask_BT].mean()) if mask_BT.any() else 0.0},
    )


@dataclass(frozen=True)
class ContrastiveParams:
    weight: float = 1.0
    """lambda: weight of the contrastive gap."""


def contrastive_sd(inputs: adv.AdvantageInputs, cfg: adv.AdvantageConfig) -> adv.AdvantageOutputs:
    """RLCSD: the teacher-student gap under a correct hint minus the gap under a wrong hint.

        c_t     = (log q(y_t | correct hint) - log p(y_t)) - (log q(y_t | wrong hint) - log p(y_t))
                = log q(y_t | correct hint) - log q(y_t | wrong hint)
        A_{i,t} = A_i^GRPO + lambda c_t

    The style shift any hint induces cancels; what remains is concentrated on task-bearing
    tokens. "RLCSD: Reinforcement Learning with Contrastive On-Policy Self-Distillation", 2026,
    arXiv:2606.11709. lambda = 1 is this library's default; lambda = 0 is GRPO.
    Tokens without both teacher logprobs (no teacher: `teacher_mask_BT`; no wrong hint: a
    non-finite `wrong_hint_logprobs_BT`, NaN as the batch gives it) get the GRPO advantage.
    """
    p = resolve(ContrastiveParams, cfg.params, "contrastive_sd")
    gap_BT, mask_BT = _gap(inputs, "contrastive_sd")
    teacher_ok_BT, _ = _teacher_ok(inputs, "contrastive_sd")
    wrong_BT = _need(inputs, "wrong_hint_logprobs_BT", "contrastive_sd").double()
    rollout_BT = inputs.rollout_logprobs_BT.double()  # type: ignore[union-attr]
    ok_BT = teacher_ok_BT & torch.isfinite(wrong_BT)
    c_BT = torch.where(ok_BT, gap_BT - (wrong_BT - rollout_BT), 0.0)
    base = _grpo_B(inputs, cfg)
    return _out(base, _spread(base.advantages_B, mask_BT) + p.weight * c_BT, mask_BT)


TOKEN_ADVANTAGES: dict[str, Callable[[Any, Any], adv.AdvantageOutputs]] = {
    "tempo": tempo,
    "ktae": ktae,
    "zero_variance": zero_variance,
    "miner": miner,
    "a3po": a3po,
    "turn_level": turn_level,
    "segment": segment,
    "rlsd": rlsd,
    "sdar_gate": sdar_gate,
    "contrastive_sd": contrastive_sd,
}
"""Token-level estimators, merged into `advantages.ADVANTAGES`."""

TOKEN_ADVANTAGE_PARAMS: dict[str, type] = {
    "tempo": TempoParams,
    "ktae": KtaeParams,
    "zero_variance": ZeroVarianceParams,
    "miner": MinerParams,
    "a3po": A3POParams,
    "rlsd": RLSDParams,
    "sdar_gate": SDARParams,
    "contrastive_sd": ContrastiveParams,
    "turn_level": NoParams,
    "segment": NoParams,
}
"""Parameter dataclass of each token-level estimator (`NoParams`: takes none)."""
