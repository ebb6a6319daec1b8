"""Worked examples for the sampling math (SGLang semantics)."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from flywheel.engine.sampling import (
    SamplingConfig,
    sample_tokens,
    tempered_logprobs,
    top_logprobs,
    truncated_probs,
)


def test_tempered_logprobs_divide_by_temperature_and_greedy_is_raw():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    out = tempered_logprobs(
        logits, [SamplingConfig(temperature=2.0), SamplingConfig(temperature=0)]
    )
    # T=2: logits/T = [0.5, 1, 1.5]; logsumexp = 1.5 + log(1 + e^-0.5 + e^-1) = 1.5 + 0.4076...
    lse = 1.5 + math.log(1 + math.exp(-0.5) + math.exp(-1.0))
    assert_close(out[0], torch.tensor([0.5 - lse, 1.0 - lse, 1.5 - lse]))
    # greedy (T=0) reports raw log_softmax(logits): lse = 3 + log(1 + e^-1 + e^-2)
    lse = 3.0 + math.log(1 + math.exp(-1.0) + math.exp(-2.0))
    assert_close(out[1], torch.tensor([1.0 - lse, 2.0 - lse, 3.0 - lse]))


def _lp(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_top_k_top_p_min_p_keep_the_expected_tokens():
    lp = _lp([0.2, 0.5, 0.3])  # sorted: 0.5 (id 1), 0.3 (id 2), 0.2 (id 0)
    kept = lambda cfg: (truncated_probs(lp, [cfg])[0] > 0).tolist()  # noqa: E731
    assert kept(SamplingConfig(top_k=2)) == [False, True, True]
    # top_p: keep a token while the mass before it is < top_p: before id 2 the mass is 0.5
    assert kept(SamplingConfig(top_p=0.45)) == [False, True, False]
    assert kept(SamplingConfig(top_p=0.55)) == [False, True, True]
    # min_p 0.5: keep p >= 0.5 * 0.5 = 0.25
    assert kept(SamplingConfig(min_p=0.5)) == [False, True, True]
    assert kept(SamplingConfig(min_p=0.7)) == [False, True, False]
    assert kept(SamplingConfig(top_k=-1)) == [True, True, True]
    assert kept(SamplingConfig(top_k=1 << 30)) == [True, True, True]


def test_sampling_is_seeded_per_row_and_respects_truncation():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    allowed = set(logits[0].topk(3).indices.tolist())
    lp = tempered_logprobs(logits, [cfg])

    def draws(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [int(sample_tokens(lp, [cfg], [g])[0]) for _ in range(40)]

    first, again, other = draws(1), draws(1), draws(2)
    assert first == again
    assert first != other
    assert set(first) | set(other) <= allowed
    assert len(set(first) | set(other)) > 1


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    cfgs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=1)]
    lp = tempered_logprobs(logits, cfgs)
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)]
    assert sample_tokens(lp, cfgs, gens).tolist() == [1, 1]


def test_top_logprobs_most_likely_first():
    values, ids = top_logprobs(_lp([0.2, 0.5, 0.3])[0], 2)
    assert ids == [1, 2]
    assert_close(torch.tensor(values), torch.tensor([math.log(0.5), math.log(0.3)]))


def test_sampled_frequencies_follow_the_distribution():
    # probs [0.1, 0.2, 0.7]: 4000 draws, each frequency within 0.03 (about 4.5 standard errors)
    lp = _lp([0.1, 0.2, 0.7])
    cfg = SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[int(sample_tokens(lp, [cfg], [g])[0])] += 1
    assert_close(counts / 4000, torch.tensor([0.1, 0.2, 0.7]), atol=0.03, rtol=0)
