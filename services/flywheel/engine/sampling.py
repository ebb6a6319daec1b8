"""Per-row sampling on a batch of next-token logits (SGLang semantics).

The reported logprob of a sampled token is `log_softmax(logits / T)` of the sampling distribution
BEFORE top-k / top-p / min-p truncation, and raw `log_softmax(logits)` for greedy rows
(temperature in [0, 1e-6)). Truncation is applied on the probabilities sorted in descending order:
top-k, then top-p (keep a token while the mass before it is below top_p), then min-p (relative to
the most likely token); the first token is always kept. Each row samples with its own
`torch.Generator`, so a seeded request gives the same tokens alone or in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GREEDY_BELOW = 1e-6
"""Temperatures in [0, GREEDY_BELOW) mean greedy decoding (SGLang rewrites them to top_k 1)."""
ALL_TOKENS = 1 << 30
"""SGLang's top_k default, meaning no top-k truncation (as does -1)."""


@dataclass(frozen=True)
class SamplingConfig:
    """The distribution-shaping part of one request's sampling_params."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = ALL_TOKENS
    """-1 or >= vocabulary size = all tokens."""
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or 0 < self.top_k < ALL_TOKENS or self.min_p > 0.0


def tempered_logprobs(logits: Tensor, configs: list[SamplingConfig]) -> Tensor:
    """log_softmax(logits / T) per row, T = 1 for greedy rows; float32.

    Args:
        logits: (B, V) next-token logits, any float dtype.
        configs: B sampling configs.

    Returns:
        (B, V) float32 logprobs of the untruncated sampling distribution.
    """
    temps = [1.0 if c.temperature < GREEDY_BELOW else c.temperature for c in configs]
    logits = logits.float()
    if any(t != 1.0 for t in temps):
        t = torch.tensor(temps, dtype=torch.float32, device=logits.device)
        logits = logits / t.unsqueeze(1)  # (B, V)
    return torch.log_softmax(logits, dim=-1)


def truncated_probs(logprobs: Tensor, configs: list[SamplingConfig]) -> Tensor:
    """Probabilities after top-k, top-p and min-p truncation (unnormalized is fine for multinomial).

    Args:
        logprobs: (B, V) from `tempered_logprobs`.
        configs: B sampling configs.

    Returns:
        (B, V) float32 probabilities, zero outside each row's kept set.
    """
    probs = logprobs.exp()  # (B, V)
    if not any(c.truncates and not c.greedy for c in configs):
        return probs
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
    dev = probs.device
    rank = torch.arange(vocab, device=dev).unsqueeze(0)  # (1, V)
    top_k = torch.tensor([c.top_k if 0 < c.top_k < vocab else vocab for c in configs], device=dev)
    top_k = top_k.unsqueeze(1)  # (B, 1)
    top_p = torch.tensor([c.top_p for c in configs], dtype=torch.float32, device=dev).unsqueeze(1)
    min_p = torch.tensor([c.min_p for c in configs], dtype=torch.float32, device=dev).unsqueeze(1)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # (B, V)
    keep = (rank < top_k) & (mass_before < top_p) & (sorted_p >= min_p * sorted_p[:, :1])
    keep[:, 0] = True
    kept_sorted = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter_(1, order, kept_sorted)


def sample_tokens(
    logprobs: Tensor,
    configs: list[SamplingConfig],
    generators: list[torch.Generator],
) -> Tensor:
    """Pick one token per row: argmax for greedy rows, a seeded random draw otherwise.

    Args:
        logprobs: (B, V) from `tempered_logprobs`.
        configs: B sampling configs.
        generators: B per-row generators (used only by sampled rows).

    Returns:
        (B,) int64 token ids.
    """
    tokens = logprobs.argmax(dim=-1)  # (B,)
    sampled_rows = [i for i, c in enumerate(configs) if not c.greedy]
    if sampled_rows:
        probs = truncated_probs(logprobs, configs)
        for i in sampled_rows:
            # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability
            # p_i / sum(p) (exact, like vLLM's sampler) and is cheaper than torch.multinomial
            race = torch.empty(probs.shape[-1]).exponential_(generator=generators[i])
            race = race.to(probs.device)
            tokens[i] = (probs[i] / race).argmax()
    return tokens


def top_logprobs(logprobs: Tensor, k: int) -> tuple[list[float], list[int]]:
    """The k most likely tokens of one (V,) logprob row, most likely first."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
    return values.tolist(), ids.tolist()
