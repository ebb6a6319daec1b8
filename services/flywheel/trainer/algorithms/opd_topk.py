"""The distillation term of `opd_plus_rl` restricted to the student's top-k tokens.

OpenClaw-RL's second version ("OpenClaw-RL: Train Any Agent Simply by Talking",
arXiv:2603.10165) restricts the on-policy distillation term to the student's top-k tokens. The
teacher scores only the tokens the student sampled (its logprob of a_t under the hinted context),
so the restriction Flywheel applies is per position: with `student_topk = k` > 0 in
`[trainer.algorithm.params.opd_plus_rl]`, the term

    w_opd * clip(log pi_teacher(a_t | s + hint) - log pi_old(a_t | s))

counts only where the sampled token a_t is among the student's k most likely tokens at t
(rank_t < k, rank_t = number of vocabulary tokens with a strictly larger logit); elsewhere the
token keeps only the reward term w_rl * r (live) or w_rl * A_group (grouped). The student is the
policy being trained, ranked without gradient once per step before the micro-batches (for a
fresh Sample, the weights that sampled it; the temperature does not change a rank). Positions
where the student itself found the sampled token unlikely (a tail sample) then carry no teacher
signal, which is where a hinted teacher's logprob gap is largest and least reliable.

Worked example (w_opd = w_rl = 1, reward 1, k = 2): teacher logprobs (-1.0, -2.0), rollout
logprobs (-1.5, -1.0) -> gaps (0.5, -1.0), advantages (1.5, 0.0); the student ranks the two
sampled tokens 0 and 3 -> the second leaves the top-2 -> advantages (1.5, 1.0).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flywheel.trainer.algorithms.advantages import OPDPlusRLParams, clip_gap
from flywheel.trainer.algorithms.context import masked


def sampled_ranks(logits_BTV: Tensor, input_ids_BT: Tensor) -> Tensor:
    """(B, T) int64 rank of each token under the distribution it was drawn from: position t
    counts the vocabulary entries whose logit at t - 1 is strictly larger than token t's
    (0 = the most likely). Position 0 has no distribution and is -1.

    Example: logits at t - 1 (2.0, 5.0, 1.0, 3.0), token t = 3 -> rank 1 (only 5.0 is larger).
    """
    logits_BT1V = logits_BTV[:, :-1]
    chosen_BT1 = logits_BT1V.gather(2, input_ids_BT[:, 1:, None])  # (B, T-1, 1)
    ranks_BT1 = (logits_BT1V > chosen_BT1).sum(dim=-1)
    return torch.nn.functional.pad(ranks_BT1, (1, 0), value=-1)


@torch.no_grad()
def student_ranks(model: Any, batch: Any, cfg: Any) -> Tensor:
    """(B, T) int64 rank of every sampled token under the current weights (`sampled_ranks`),
    -1 off the loss mask. One no-grad forward per micro-batch (the training pass's
    `micro_batch_size` / `micro_batch_tokens`), logits (N, T, V) of one micro-batch at a time.
    """
    from flywheel.trainer.batch import micro_batch_rows  # noqa: PLC0415

    device = next(model.parameters()).device
    ranks_BT = torch.full(batch.loss_mask_BT.shape, -1, dtype=torch.int64)
    for rows_N in micro_batch_rows(
        batch, cfg.batch.micro_batch_size, cfg.batch.micro_batch_tokens, False
    ):
        mb = batch.select(rows_N)
        if not bool(mb.loss_mask_BT.any()):
            continue
        mbd = mb.to(device)
        logits = model(input_ids=mbd.input_ids_BT, attention_mask=mbd.attention_mask_BT).logits
        ranks = sampled_ranks(logits, mbd.input_ids_BT).cpu()
        ranks_BT[rows_N, : ranks.shape[1]] = ranks
    return torch.where(batch.loss_mask_BT.bool(), ranks_BT, torch.full_like(ranks_BT, -1))


def opd_topk_rows(cfg: Any, batch: Any) -> tuple[Tensor, OPDPlusRLParams | None]:
    """Rows whose advantages hold an `opd_plus_rl` distillation term with `student_topk` > 0
    (grouped rows when it is the advantage, live rows when it is `live_advantage`), and its
    parameters; (empty, None) when the option is off."""
    params = None
    if "opd_plus_rl" in (cfg.algo.advantage, cfg.algorithm.live_advantage):
        params = cfg.algo.part_params("opd_plus_rl")
    if not isinstance(params, OPDPlusRLParams) or params.student_topk == 0:
        return torch.zeros(0, dtype=torch.int64), None
    rows_B = torch.zeros_like(batch.live_B)
    if cfg.algo.advantage == "opd_plus_rl":
        rows_B |= ~batch.live_B
    if cfg.algorithm.live_advantage == "opd_plus_rl":
        rows_B |= batch.live_B
    return rows_B.nonzero(as_tuple=True)[0], params


def restrict_to_student_topk(
    advantages_BT: Tensor,
    teacher_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    teacher_mask_BT: Tensor,
    loss_mask_BT: Tensor,
    ranks_BT: Tensor,
    params: OPDPlusRLParams,
) -> tuple[Tensor, dict[str, float]]:
    """`advantages_BT` of `opd_plus_rl` rows without the distillation term where the sampled
    token is outside the student's top `params.student_topk` (module docstring).

    Args:
        advantages_BT: (B, T) w_opd * clip(gap) + w_rl * (reward part), 0 off the loss mask.
        teacher_logprobs_BT, rollout_logprobs_BT: (B, T) the gap's two sides.
        teacher_mask_BT, loss_mask_BT: (B, T) bool.
        ranks_BT: (B, T) int64 student rank of each sampled token (`student_ranks`).

    Returns:
        (advantages_BT (B, T) float32, metrics `adv/opd_student_topk_frac`: the fraction of
        teacher-scored loss tokens that kept their distillation term).
    """
    teacher_BT = teacher_mask_BT.bool() & loss_mask_BT.bool()
    gap_BT = torch.where(
        teacher_BT,
        (teacher_logprobs_BT.double() - rollout_logprobs_BT.double()).float(),
        0.0,
    )
    gap_BT = clip_gap(gap_BT, params.gap_clip)
    outside_BT = teacher_BT & (ranks_BT >= params.student_topk)
    adv_BT = advantages_BT - torch.where(outside_BT, params.opd_weight * gap_BT, 0.0)
    scored = int(teacher_BT.sum())
    kept = scored - int(outside_BT.sum())
    return masked(adv_BT.float(), loss_mask_BT), {
        "adv/opd_student_topk_frac": kept / scored if scored else 0.0
    }
