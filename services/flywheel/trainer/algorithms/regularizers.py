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

from collections.abc import Callable

import torch
from torch import Tensor

from flywheel.trainer.algorithms.losses import LOG_RATIO_LIMIT


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


def entropy_bonus(entropy_BT: Tensor, coef: float) -> Tensor:
    """Entropy bonus as a loss term: l_t = -coef * H_t, (B, T), H_t in nats.

    Minimizing it raises the policy entropy (Williams & Peng 1991; used as in PPO,
    arXiv:1707.06347 eq. 9, c2 ~ 0.01). Needs an entropy with a gradient: the step's
    `selected_token_logprobs` entropy is a detached statistic, so this is not wired yet.
    """
    return -coef * entropy_BT


KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimatorFn] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Per-token KL(pi || ref) estimators by name."""

REGULARIZERS: dict[str, Callable[[Tensor, float], Tensor]] = {"entropy_bonus": entropy_bonus}
"""Other per-token regularizer terms by name."""
