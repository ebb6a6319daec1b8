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

Packing (`packed=True`, trainer `batch_layout = "packed"`): the decoder runs over the rows'
real tokens laid end to end in one sequence (per-sample position ids, block-diagonal causal
mask), so no padded position is computed; the outputs return in the padded (B, T) layout.

Precision: the head always runs in float32 (autocast is switched off inside it and bf16 hidden
states are upcast), so the logprobs that enter the importance ratio have the same precision
whether or not the decoder runs under bf16 autocast. The entropy output carries a gradient, so
an entropy bonus can be trained (its backward is fused the same way).

Assumes `logits = lm_head(base_model(x).last_hidden_state)` (Llama, Qwen, Mistral families); a
model with logit soft-capping or scaling would need its own head function here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx
from transformers import PreTrainedModel

from flywheel.trainer.grad_sinks import adds_into_grad, input_embeddings
from flywheel.trainer.shared_prefix import right_padded_lengths, shared_prefix_hidden
from flywheel.trainer.shared_prefix_packed import shared_prefix_packed_hidden


@dataclass(frozen=True)
class TokenLogprobs:
    logprobs_BT: Tensor
    """(B, T) logprob of token t given tokens < t; 0 where not scored (and at t = 0). float32
    (float64 for a float64 model)."""
    entropy_BT: Tensor
    """(B, T) entropy (nats) of the tempered next-token distribution (differentiable); 0 where
    not scored."""


def _logits(hidden_CH: Tensor, weight_VH: Tensor, temperature_C: Tensor) -> Tensor:
    """(C, V) float32 logits / T, computed in float32 with autocast off (bf16 inputs upcast)."""
    with torch.autocast(device_type=hidden_CH.device.type, enabled=False):
        logits_CV = F.linear(_at_least_fp32(hidden_CH), _at_least_fp32(weight_VH))
    return logits_CV.div_(temperature_C.to(logits_CV.dtype)[:, None])


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.float() if x.element_size() < 4 else x


class TemperedHeadLogprob(torch.autograd.Function):
    """For one chunk of C positions: logprob_c = log_softmax(h_c W^T / T_c)[y_c] and the entropy
    H_c of that distribution, keeping only (C,) statistics for backward.

    Backward, with g = dL/dlogprob, e = dL/dH, p = softmax(z / T), log p its log:
        dL/dz_cv = [g_c (onehot(y_c)_v - p_cv) - e_c p_cv (log p_cv + H_c)] / T_c
        dL/dh = (dL/dz) W;   dL/dW = (dL/dz)^T h
    (dH/ds_v = -p_v (log p_v + H) for s = z / T.) Gradients are returned in the dtype of the
    inputs.
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
        ctx.save_for_backward(hidden_CH, weight_VH, targets_C, temperature_C, lse_C, entropy_C)
        ctx.weight_param = weight_VH  # type: ignore[attr-defined]  # the Parameter: adds_into_grad
        ctx.set_materialize_grads(False)
        return logprobs_C, entropy_C

    @staticmethod
    def backward(
        # a BackwardCFunction, whose stub types saved_tensors as a 1-tuple
        ctx: Any,
        grad_C: Tensor | None,
        grad_entropy_C: Tensor | None,
    ) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden_CH, weight_VH, targets_C, temperature_C, lse_C, entropy_C = ctx.saved_tensors
        if grad_C is None and grad_entropy_C is None:
            return None, None, None, None
        logp_CV = _logits(hidden_CH, weight_VH, temperature_C).sub_(lse_C[:, None])
        inv_t_C = 1.0 / temperature_C.to(logp_CV.dtype)
        g_C = grad_C.to(logp_CV.dtype) if grad_C is not None else torch.zeros_like(lse_C)
        if grad_entropy_C is None:
            grad_CV = logp_CV.exp_().mul_(-(g_C * inv_t_C)[:, None])  # -g p / T
        else:
            e_C = grad_entropy_C.to(logp_CV.dtype)
            p_CV = logp_CV.exp()
            # -p (g + e (log p + H)) / T
            logp_CV.add_(entropy_C[:, None]).mul_(e_C[:, None]).add_(g_C[:, None])
            grad_CV = p_CV.mul_(logp_CV).mul_(-inv_t_C[:, None])
        grad_CV.scatter_add_(1, targets_C[:, None], (g_C * inv_t_C)[:, None])  # + g onehot / T
        grad_hidden = grad_weight = None
        with torch.autocast(device_type=hidden_CH.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_hidden = (grad_CV @ _at_least_fp32(weight_VH)).to(hidden_CH.dtype)
            if ctx.needs_input_grad[1] and adds_into_grad(ctx.weight_param):
                ctx.weight_param.grad.addmm_(grad_CV.T, _at_least_fp32(hidden_CH))
            elif ctx.needs_input_grad[1]:
                grad_weight = (grad_CV.T @ _at_least_fp32(hidden_CH)).to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None


def decoder_of(model: Any) -> Any:
    """The decoder stack of a causal LM (`model.base_model`: embeddings and layers, no head),
    also through a peft LoRA wrapper, whose own `base_model` is the adapter model that returns
    the whole LM's output (the adapters live inside the decoder's layers)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model


def selected_token_logprobs(
    model: PreTrainedModel,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    temperature_B: Tensor,
    score_mask_BT: Tensor,
    chunk_tokens: int = 1024,
    packed: bool = False,
    shared_prefix: bool = False,
) -> TokenLogprobs:
    """Logprobs of the tokens where `score_mask_BT` is set, under `model` at temperature T_b.

    `packed`: the decoder runs once over the B rows' real tokens laid end to end in one row
    of N = sum of lengths (`_packed_hidden`), instead of over B x T padded positions; the
    results are the same (up to float rounding) and come back in the padded (B, T) layout.
    `shared_prefix`: rows sharing a prompt run it once, in one packed pass with a prompt-sharing
    mask (`shared_prefix_packed.shared_prefix_packed_hidden`) where the micro-batch is small
    enough, else on the prompt's key/value cache (`shared_prefix.shared_prefix_hidden`); same
    results up to float rounding, in the padded layout.

    Args:
        model: a causal LM whose logits are `get_output_embeddings()(base_model(...) hidden)`.
        input_ids_BT: (B, T) int64 token ids, right-padded.
        attention_mask_BT: (B, T) 1 on real tokens, 0 on padding.
        temperature_B: (B,) float sampling temperature of each row (> 0).
        score_mask_BT: (B, T) bool, positions to score; column 0 must be False (no context).
        chunk_tokens: scored positions per lm-head chunk.
        packed: run the decoder padding-free (see above).
        shared_prefix: run each shared prompt once (see above).

    Raises:
        ValueError: position 0 is scored; `packed` or `shared_prefix` with a mask that is not
            right padding; both `packed` and `shared_prefix`.

    Returns:
        `TokenLogprobs` with (B, T) tensors aligned with `input_ids_BT`.
    """
    score_BT = score_mask_BT.bool()
    if bool(score_BT[:, 0].any()):
        raise ValueError("position 0 has no context and cannot be scored; mask it out")
    batch, seq = input_ids_BT.shape
    select_BT1 = score_BT[:, 1:]  # (B, T-1): token t+1 is predicted from hidden t
    if packed and shared_prefix:
        raise ValueError("choose one layout: packed or shared_prefix")
    if packed:
        hidden_XH, source_BT = _packed_hidden(model, input_ids_BT, attention_mask_BT)
        hidden_NH = hidden_XH[source_BT[:, :-1][select_BT1]]
    elif shared_prefix and (
        one_pass := shared_prefix_packed_hidden(decoder_of(model), input_ids_BT, attention_mask_BT)
    ):
        hidden_XH, source_BT = one_pass
        hidden_NH = hidden_XH[source_BT[:, :-1][select_BT1]]
    elif shared_prefix:
        hidden_XH = shared_prefix_hidden(decoder_of(model), input_ids_BT, attention_mask_BT)
        hidden_NH = hidden_XH[:, :-1][select_BT1]
    else:
        decoder = decoder_of(model)
        hidden_XH = decoder(
            inputs_embeds=input_embeddings(decoder, input_ids_BT),
            attention_mask=attention_mask_BT,
            use_cache=False,
        ).last_hidden_state
        hidden_NH = hidden_XH[:, :-1][select_BT1]
    targets_N = input_ids_BT[:, 1:][select_BT1]
    out_dtype = torch.promote_types(hidden_XH.dtype, torch.float32)  # float32 under autocast
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
        logprobs_BT1 = zeros_BT1 + 0.0 * hidden_XH.sum()
        entropy_BT1 = zeros_BT1
    return TokenLogprobs(
        logprobs_BT=F.pad(logprobs_BT1, (1, 0)),
        entropy_BT=F.pad(entropy_BT1, (1, 0)),
    )


def _packed_hidden(
    model: PreTrainedModel, input_ids_BT: Tensor, attention_mask_BT: Tensor
) -> tuple[Tensor, Tensor]:
    """Decoder hidden states of the rows' real tokens packed into one sequence.

    The N = sum_b L_b real tokens go in as one (1, N) row with position_ids restarting at 0 for
    each sample and no attention mask; transformers (>= 4.53, `find_packed_sequence_indices`)
    then builds a block-diagonal causal mask from the position restarts, so no token attends
    across a sample boundary (sdpa, eager and flash kernels alike). Positions are 0..L_b - 1,
    as in the padded path. Example: lengths (3, 1) -> input (a0 a1 a2 b0), positions
    (0 1 2 0), source index of (b, t) = (0 1 2 -) / (3 - - -).

    Attention cost is that of one N-token sequence (N^2 scores where the padded path has
    B T^2), so packing pays when the decoder's per-token work (MLP, projections) dominates:
    short-to-medium samples of very different lengths. A micro-batch token budget bounds N.

    Returns:
        (N, H) hidden states and the (B, T) int64 index of each position's row in them (only
        meaningful where attention_mask_BT is 1).

    Raises:
        ValueError: the attention mask is not right padding (real tokens first in every row).
    """
    right_padded_lengths(attention_mask_BT, "packed")
    real_BT = attention_mask_BT.bool()
    position_BT = real_BT.long().cumsum(dim=1) - 1
    source_BT = (real_BT.flatten().long().cumsum(dim=0) - 1).view_as(position_BT)
    decoder = decoder_of(model)
    hidden_1NH = decoder(
        inputs_embeds=input_embeddings(decoder, input_ids_BT[real_BT][None]),
        position_ids=position_BT[real_BT][None],
        attention_mask=None,
        use_cache=False,
    ).last_hidden_state
    return hidden_1NH[0], source_BT


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
