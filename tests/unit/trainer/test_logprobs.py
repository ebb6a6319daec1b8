"""Chunked selected-token logprobs against the naive full log-softmax (values and gradients)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.logprobs import (
    TemperedHeadLogprob,
    naive_token_logprobs,
    selected_token_logprobs,
)

from .factories import VOCAB, tiny_model


def padded_batch():
    gen = torch.Generator().manual_seed(1)
    input_ids_BT = torch.randint(0, VOCAB, (3, 11), generator=gen)
    attention_mask_BT = torch.ones_like(input_ids_BT)
    attention_mask_BT[1, 7:] = 0  # right padding
    attention_mask_BT[2, 9:] = 0
    score_BT = attention_mask_BT.bool().clone()
    score_BT[:, :4] = False  # prompt
    return input_ids_BT, attention_mask_BT, score_BT


class FixedLogitsLM(torch.nn.Module):
    """A stub causal LM whose logits are `logits_V` at every position (hidden size 1)."""

    def __init__(self, logits_V: torch.Tensor):
        super().__init__()
        self.head = torch.nn.Linear(1, logits_V.numel(), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(logits_V[:, None])

    def base_model(self, input_ids, attention_mask, use_cache):
        return SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))

    def get_output_embeddings(self):
        return self.head


def test_bug07_temperature_divides_logits_not_logprobs():
    # logits z = [2, 1, 0], sampled token 0, T = 0.5:
    # correct: log_softmax(z / T)[0] = 4 - log(e^4 + e^2 + e^0) = 4 - 4.142931 = -0.142931
    # raw:     log_softmax(z)[0]     = 2 - log(e^2 + e^1 + e^0) = -0.407606
    # wrong "fix" raw / T            = -0.815213
    model = FixedLogitsLM(torch.tensor([2.0, 1.0, 0.0]))
    ids = torch.tensor([[1, 0]])
    out = selected_token_logprobs(
        model, ids, torch.ones_like(ids), torch.tensor([0.5]), torch.tensor([[False, True]])
    )
    assert float(out.logprobs_BT.detach()[0, 1]) == pytest.approx(-0.142931, abs=1e-6)
    at_t1 = selected_token_logprobs(
        model, ids, torch.ones_like(ids), torch.tensor([1.0]), torch.tensor([[False, True]])
    )
    assert float(at_t1.logprobs_BT.detach()[0, 1]) == pytest.approx(-0.407606, abs=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
def test_chunked_equals_naive_values_and_grads(chunk_tokens):
    model = tiny_model()
    ids, attn, score = padded_batch()
    temperature_B = torch.tensor([1.0, 0.6, 1.3])

    out = selected_token_logprobs(model, ids, attn, temperature_B, score, chunk_tokens=chunk_tokens)
    (out.logprobs_BT * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    naive_BT = torch.where(score, naive_token_logprobs(model, ids, attn, temperature_B), 0.0)
    (naive_BT * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()

    assert_close(out.logprobs_BT, naive_BT, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.logprobs_BT == 0, ~score)
    for name, param in model.named_parameters():
        assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_matches_full_distribution():
    model = tiny_model()
    ids, attn, score = padded_batch()
    temperature_B = torch.tensor([0.7, 1.0, 1.0])
    with torch.no_grad():
        out = selected_token_logprobs(model, ids, attn, temperature_B, score, chunk_tokens=2)
        logits = model(input_ids=ids, attention_mask=attn).logits / temperature_B[:, None, None]
        logp = torch.log_softmax(logits, dim=-1)
        entropy_BT1 = -(logp.exp() * logp).sum(-1)[:, :-1]
    expected_BT = torch.where(score, torch.nn.functional.pad(entropy_BT1, (1, 0)), 0.0)
    assert_close(out.entropy_BT, expected_BT, atol=1e-5, rtol=1e-5)


def test_position_zero_cannot_be_scored():
    model = tiny_model()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="position 0"):
        selected_token_logprobs(
            model, ids, torch.ones_like(ids), torch.ones(1), torch.ones_like(ids).bool()
        )


def test_nothing_scored_gives_zeros_and_a_backward_that_works():
    model = tiny_model()
    ids = torch.tensor([[1, 2, 3]])
    out = selected_token_logprobs(
        model, ids, torch.ones_like(ids), torch.ones(1), torch.zeros_like(ids).bool()
    )
    out.logprobs_BT.sum().backward()
    assert torch.equal(out.logprobs_BT.detach(), torch.zeros(1, 3))


def test_fused_head_backward_passes_gradcheck():
    # float64 finite differences against the hand-written backward of the fused head
    gen = torch.Generator().manual_seed(0)
    hidden_CH = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight_VH = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    targets_C = torch.tensor([0, 3, 6, 3, 1])
    temperature_C = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.0], dtype=torch.float64)

    def logprobs(h, w):
        return TemperedHeadLogprob.apply(h, w, targets_C, temperature_C)[0]

    assert torch.autograd.gradcheck(logprobs, (hidden_CH, weight_VH))
    # and the forward equals log_softmax(h W^T / T) gathered
    expected = torch.log_softmax((hidden_CH @ weight_VH.T) / temperature_C[:, None], dim=-1)
    assert_close(logprobs(hidden_CH, weight_VH), expected[torch.arange(5), targets_C])
