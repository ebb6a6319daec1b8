"""Selected-token logprobs of a causal LM at each sample's sampling temperature, chunked.

    logprob_t = log_softmax(lm_head(h_{t-1}) / T)[token_t]

which is what the engine reports for a token sampled at temperature T (SGLang's processed
logprobs, before top-p/top-k truncation; BUG-07: the temperature divides the logits, never the
logprob).

Memory: a naive `log_softmax(model(x).logits / T)` holds (B, T, V) float32 logits plus their
log-softmax, and autograd keeps them for backward (V = 49152 for SmolLM2: 200 KB per token, each).
Here the decoder runs once for hidden states, and only the scored positions (the loss mask) go
through the lm head, `chunk_tokens` rows at a time, in `TemperedHeadLogprob`: a fused
linear + log-softmax + gather whose backward recomputes the chunk's logits in place instead of
keeping them. About two (chunk_tokens, V) float32 blocks exist at a time, whatever B and T are.

Assumes `logits = lm_head(base_model(x).last_hidden_state)` (Llama, Qwen, Mistral families); a
model with logit soft-capping or scaling would need its own head function here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx
from transformers import PreTrainedModel


@dataclass(frozen=True)
class TokenLogprobs:
    logprobs_BT: Tensor
    """(B, T) logprob of token t given tokens < t; 0 where not scored (and at t = 0). float32
    (float64 for a float64 model)."""
    entropy_BT: Tensor
    """(B, T) entropy (nats) of the tempered next-token distribution; no gradient; 0 where not
    scored."""


def _logits(hidden_CH: Tensor, weight_VH: Tensor, temperature_C: Tensor) -> Tensor:
    """(C, V) logits / T in at least float32 (bf16/fp16 models are upcast)."""
    logits_CV = F.linear(hidden_CH, weight_VH)
    if logits_CV.element_size() < 4:
        logits_CV = logits_CV.float()
    return logits_CV.div_(temperature_C.to(logits_CV.dtype)[:, None])


class TemperedHeadLogprob(torch.autograd.Function):
    """For one chunk of C positions: logprob_c = log_softmax(h_c W^T / T_c)[y_c] and the entropy
    of that distribution, keeping only (C,) statistics for backward.

    Backward, with g = dL/dlogprob and p = softmax(z / T):
        dL/dz_cv = g_c (onehot(y_c)_v - p_cv) / T_c;   dL/dh = (dL/dz) W;   dL/dW = (dL/dz)^T h
    The entropy output is a statistic and carries no gradient.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden_CH: Tensor,
        weight_VH: Tensor,
        targets_C: Tensor,
        temperature_C: Tensor,
    ) -> tuple[Tensor, Tensor]:
        logits_CV = _logits(hidden_CH, weight_VH, temperature_C)
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        logprobs_C = logits_CV.gather(1, targets_C[:, None]).squeeze(1) - lse_C
        logp_CV = logits_CV.sub_(lse_C[:, None])  # in place: the full log-softmax
        entropy_C = -(logp_CV.exp() * logp_CV).sum(dim=-1)
        ctx.save_for_backward(hidden_CH, weight_VH, targets_C, temperature_C, lse_C)
        ctx.mark_non_differentiable(entropy_C)
        return logprobs_C, entropy_C

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad_C: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden_CH, weight_VH, targets_C, temperature_C, lse_C = ctx.saved_tensors
        scale_C = grad_C / temperature_C
        grad_CV = _logits(hidden_CH, weight_VH, temperature_C)
        grad_CV.sub_(lse_C[:, None]).exp_().mul_(-scale_C[:, None])  # -g p / T
        grad_CV.scatter_add_(1, targets_C[:, None], scale_C[:, None])  # + g onehot / T
        grad_CV = grad_CV.to(weight_VH.dtype)
        grad_hidden = grad_CV @ weight_VH if ctx.needs_input_grad[0] else None
        grad_weight = grad_CV.T @ hidden_CH if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def selected_token_logprobs(
    model: PreTrainedModel,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    temperature_B: Tensor,
    score_mask_BT: Tensor,
    chunk_tokens: int = 1024,
) -> TokenLogprobs:
    """Logprobs of the tokens where `score_mask_BT` is set, under `model` at temperature T_b.

    Args:
        model: a causal LM whose logits are `get_output_embeddings()(base_model(...) hidden)`.
        input_ids_BT: (B, T) int64 token ids, right-padded.
        attention_mask_BT: (B, T) 1 on real tokens, 0 on padding.
        temperature_B: (B,) float sampling temperature of each row (> 0).
        score_mask_BT: (B, T) bool, positions to score; column 0 must be False (no context).
        chunk_tokens: scored positions per lm-head chunk.

    Returns:
        `TokenLogprobs` with (B, T) tensors aligned with `input_ids_BT`.
    """
    score_BT = score_mask_BT.bool()
    if bool(score_BT[:, 0].any()):
        raise ValueError("position 0 has no context and cannot be scored; mask it out")
    batch, seq = input_ids_BT.shape
    hidden_BTH = model.base_model(
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False
    ).last_hidden_state
    select_BT1 = score_BT[:, 1:]  # (B, T-1): token t+1 is predicted from hidden t
    hidden_NH = hidden_BTH[:, :-1][select_BT1]
    targets_N = input_ids_BT[:, 1:][select_BT1]
    out_dtype = torch.promote_types(hidden_BTH.dtype, torch.float32)
    temperature_N = temperature_B.to(out_dtype)[:, None].expand(batch, seq - 1)[select_BT1]
    head_weight_VH = model.get_output_embeddings().weight

    logprob_chunks, entropy_chunks = [], []
    for start in range(0, hidden_NH.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        args = (hidden_NH[rows], head_weight_VH, targets_N[rows], temperature_N[rows])
        lp_C, ent_C = TemperedHeadLogprob.apply(*args)
        logprob_chunks.append(lp_C)
        entropy_chunks.append(ent_C)

    zeros_BT1 = torch.zeros(batch, seq - 1, dtype=out_dtype, device=input_ids_BT.device)
    if logprob_chunks:
        logprobs_BT1 = zeros_BT1.masked_scatter(select_BT1, torch.cat(logprob_chunks))
        entropy_BT1 = zeros_BT1.masked_scatter(select_BT1, torch.cat(entropy_chunks))
    else:  # nothing scored: keep the graph connected so backward still works (gives zeros)
        logprobs_BT1 = zeros_BT1 + 0.0 * hidden_BTH[:, :-1].sum(dim=-1)
        entropy_BT1 = zeros_BT1
    return TokenLogprobs(
        logprobs_BT=F.pad(logprobs_BT1, (1, 0)),
        entropy_BT=F.pad(entropy_BT1, (1, 0)),
    )


def naive_token_logprobs(
    model: PreTrainedModel,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    temperature_B: Tensor,
) -> Tensor:
    """Reference: full (B, T, V) float32 log-softmax of `model(...).logits / T`, gathered.

    Returns (B, T) with position 0 set to 0. For tests and benchmarks only.
    """
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits.float()
    logp_BTV = torch.log_softmax(logits_BTV / temperature_B.float()[:, None, None], dim=-1)
    gathered_BT1 = logp_BTV[:, :-1].gather(2, input_ids_BT[:, 1:, None]).squeeze(2)
    return F.pad(gathered_BT1, (1, 0))
