"""Small builders for the algorithm-part tests."""

from __future__ import annotations

import torch

from flywheel.trainer.algorithms.context import TokenContext


def ctx(
    adv,
    mask=None,
    *,
    entropy=None,
    old=None,
    rewards=None,
    groups=None,
    logp=None,
    step=0,
    teacher=None,
    topk=None,
) -> TokenContext:
    adv_BT = torch.tensor(adv, dtype=torch.float32)
    mask_BT = (
        torch.ones_like(adv_BT, dtype=torch.bool)
        if mask is None
        else torch.tensor(mask, dtype=torch.bool)
    )
    b = adv_BT.shape[0]

    def t(x):
        return None if x is None else torch.tensor(x, dtype=torch.float32)

    return TokenContext(
        advantages_BT=adv_BT,
        loss_mask_BT=mask_BT,
        old_logprobs_BT=t(old) if old is not None else torch.zeros_like(adv_BT),
        rewards_B=torch.tensor(rewards if rewards is not None else [0.0] * b),
        group_index_B=torch.tensor(groups if groups is not None else list(range(b))),
        entropy_BT=t(entropy),
        logprobs_BT=logp,
        teacher_logprobs_BT=t(teacher),
        topk_logprobs_BTK=topk,
        step=step,
    )
