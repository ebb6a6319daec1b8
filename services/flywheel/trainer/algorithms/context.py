"""What token-level parts (weights, late advantages, regularizers) read: one `TokenContext`.

Shapes: B = samples, T = tokens (right-padded, aligned with `token_ids`: position t holds the
logprob of token t given tokens < t). Optional fields are None unless a selected part declares
them in its `inputs` (catalog.py); `pipeline.py` computes them only then.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenContext:
    advantages_BT: Tensor
    """(B, T) float32 advantage of each token (0 off the loss mask)."""
    loss_mask_BT: Tensor
    """(B, T) bool, True on trained (sampled) tokens."""
    old_logprobs_BT: Tensor
    """(B, T) rollout logprob of each token (the behaviour policy)."""
    rewards_B: Tensor
    """(B,) scalar reward of each sample."""
    group_index_B: Tensor
    """(B,) int64 group of each sample (0..G-1)."""
    logprobs_BT: Tensor | None = None
    """(B, T) current-policy logprob (with grad in the micro-batch stage, detached otherwise)."""
    entropy_BT: Tensor | None = None
    """(B, T) detached entropy (nats) of the next-token distribution; 0 off the mask."""
    token_ids_BT: Tensor | None = None
    """(B, T) int64 token ids."""
    teacher_logprobs_BT: Tensor | None = None
    """(B, T) teacher logprob of each token (0 where no teacher)."""
    topk_logprobs_BTK: Tensor | None = None
    """(B, T, K) current-policy logprobs of the K most likely tokens at each position, descending
    (with grad in the micro-batch stage)."""
    teacher_topk_logprobs_BTK: Tensor | None = None
    """(B, T, K) teacher logprobs of its K most likely tokens at each position."""
    student_at_teacher_topk_BTK: Tensor | None = None
    """(B, T, K) current-policy logprobs of the teacher's top-K tokens (with grad)."""
    step: int = 0
    """Optimizer steps taken before this one (for schedules)."""

    def with_advantages(self, advantages_BT: Tensor) -> TokenContext:
        return replace(self, advantages_BT=advantages_BT)


def masked(value_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """`value_BT` with exactly 0 off the mask (NaN there cannot leak)."""
    return torch.where(mask_BT.bool(), value_BT, torch.zeros_like(value_BT))


def require(ctx: TokenContext, name: str, part: str) -> Tensor:
    """The optional field `name` of `ctx`, or ValueError saying which part needs it."""
    value = getattr(ctx, name)
    if value is None:
        raise ValueError(f"{part} needs {name}; declare it in catalog.py inputs")
    return value


def masked_quantile(value_BT: Tensor, mask_BT: Tensor, q: float) -> float:
    """The q-quantile (linear interpolation) of `value_BT` over masked positions; 0 if none."""
    selected = value_BT[mask_BT.bool()].double()
    if selected.numel() == 0:
        return 0.0
    return float(torch.quantile(selected, q))
