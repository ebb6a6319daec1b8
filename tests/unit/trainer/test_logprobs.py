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


class OnesDecoder(torch.nn.Module):
    """A stub decoder whose hidden state is 1 at every position (hidden size 1)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 1)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, inputs_embeds, attention_mask, use_cache):
        return SimpleNamespace(last_hidden_state=torch.ones(*inputs_embeds.shape[:2], 1))


class FixedLogitsLM(torch.nn.Module):
    """A stub causal LM whose logits are `logits_V` at every position (hidden size 1)."""

    def __init__(self, logits_V: torch.Tensor):
        super().__init__()
        self.head = torch.nn.Linear(1, logits_V.numel(), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(logits_V[:, None])

        self.base_model = OnesDecoder(logits_V.numel())

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


def naive_entropy(model, input_ids_BT, attention_mask_BT, temperature_B):
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits.float()
    logp_BTV = torch.log_softmax(logits_BTV / temperature_B[:, None, None], dim=-1)
    entropy_BT1 = -(logp_BTV.exp() * logp_BTV).sum(-1)[:, :-1]
    return torch.nn.functional.pad(entropy_BT1, (1, 0))


def test_entropy_and_its_gradient_match_the_naive_log_softmax():
    # loss = sum_t (w1_t logprob_t + w2_t H_t): both outputs carry a gradient through the fused
    # head (dH/ds = -p (log p + H)); compared with autograd through the full log-softmax.
    ids, attn, score = padded_batch()
    temps = torch.tensor([0.7, 1.0, 1.3])
    w1 = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    w2 = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    fused_model, naive_model = tiny_model(seed=4), tiny_model(seed=4)
    out = selected_token_logprobs(fused_model, ids, attn, temps, score, chunk_tokens=5)
    ((out.logprobs_BT * w1).sum() + (out.entropy_BT * w2).sum()).backward()
    lp_ref = torch.where(score, naive_token_logprobs(naive_model, ids, attn, temps), 0.0)
    ent_ref = torch.where(score, naive_entropy(naive_model, ids, attn, temps), 0.0)
    ((lp_ref * w1).sum() + (ent_ref * w2).sum()).backward()
    assert_close(out.entropy_BT.detach(), ent_ref.detach(), atol=1e-5, rtol=1e-5)
    for (name, p_fused), p_naive in zip(
        fused_model.named_parameters(), naive_model.parameters(), strict=True
    ):
        assert_close(p_fused.grad, p_naive.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_bf16_autocast_keeps_the_head_and_logprobs_in_float32():
    # Under bf16 autocast the decoder runs in bf16, but the head is float32: the logprobs are
    # float32 and within bf16 decoder noise of the fp32 ones; the entropy gradient still flows.
    ids, attn, score = padded_batch()
    temps = torch.tensor([1.0, 0.7, 1.0])
    model = tiny_model(seed=6)
    fp32 = selected_token_logprobs(model, ids, attn, temps, score).logprobs_BT.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = selected_token_logprobs(model, ids, attn, temps, score)
    assert out.logprobs_BT.dtype == torch.float32
    assert_close(out.logprobs_BT.detach(), fp32, atol=5e-2, rtol=0)
    (out.logprobs_BT.sum() + out.entropy_BT.sum()).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_fused_head_entropy_backward_passes_gradcheck():
    # both outputs (logprob and entropy) against float64 finite differences
    gen = torch.Generator().manual_seed(1)
    hidden_CH = torch.randn(4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight_VH = torch.randn(6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    targets_C = torch.tensor([5, 0, 2, 2])
    temperature_C = torch.tensor([0.6, 1.0, 1.5, 1.0], dtype=torch.float64)

    def both(h, w):
        return TemperedHeadLogprob.apply(h, w, targets_C, temperature_C)

    def entropy_only(h, w):
        return TemperedHeadLogprob.apply(h, w, targets_C, temperature_C)[1]

    assert torch.autograd.gradcheck(both, (hidden_CH, weight_VH))
    assert torch.autograd.gradcheck(entropy_only, (hidden_CH, weight_VH))


def test_second_micro_batch_adds_the_head_gradient_into_grad():
    # Two backward passes (two micro-batches) through the tied head of the tiny model: the
    # second adds its head gradient straight into `.grad` (no (V, H) temporary returned to
    # autograd); the accumulated gradients must equal autograd's own accumulation of the same
    # two passes through the naive log-softmax.
    model = tiny_model(seed=2)
    ids, attn, score = padded_batch()
    temperature_B = torch.tensor([1.0, 0.6, 1.3])
    weights = torch.linspace(0.5, 1.5, ids.shape[1])
    head = model.get_output_embeddings().weight
    assert head is model.get_input_embeddings().weight  # tied: the embedding adds into it too
    calls = []
    original = torch.Tensor.addmm_

    def spy(self, *args, **kwargs):
        calls.append(self is head.grad)
        return original(self, *args, **kwargs)

    for k in range(2):
        out = selected_token_logprobs(model, ids, attn, temperature_B, score, chunk_tokens=8)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "addmm_", spy)
            ((k + 1) * out.logprobs_BT * weights).sum().backward()
    assert calls and all(calls)  # only the second pass, into the existing gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    for k in range(2):
        naive_BT = torch.where(score, naive_token_logprobs(model, ids, attn, temperature_B), 0.0)
        ((k + 1) * naive_BT * weights).sum().backward()
    for name, param in model.named_parameters():
        assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
